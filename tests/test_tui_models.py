"""The model picker (F7, /model) on the pilot: it lists the machine's models with what fits
marked, refuses one that cannot run, switches to another by row or by name, and the next
start remembers the choice."""

from __future__ import annotations

import shutil

import pytest
from gguf import GGMLQuantizationType as Q
from textual.widgets import DataTable

from lucedesk.tui.engine_host import EngineHost
from lucedesk.tui.screens.main import MainScreen
from lucedesk.tui.screens.models import ModelsScreen
from tests.gguf_writer import write_gguf
from tests.test_tui import (
    SIZE,
    make_app,
    prepare,
    replied,
    started,
    type_and_send,
    wait_for,
)


@pytest.fixture
def env(tmp_path, monkeypatch, tiny_llama):
    return prepare(tmp_path, monkeypatch, tiny_llama)


def rows(screen: ModelsScreen) -> dict[str, str]:
    table = screen.query_one(DataTable)
    return {table.get_row_at(i)[1]: table.get_row_at(i)[0] for i in range(table.row_count)}


def lm_studio(tmp_path, monkeypatch, tiny_llama) -> None:
    """LM Studio's folder with the tiny model (a safetensors folder) and a GGUF of an
    architecture lucedesk does not run."""
    home = tmp_path / "home"
    models = home / ".lmstudio" / "models" / "acme"
    shutil.copytree(tiny_llama, models / "tiny-llama")
    (models / "odd-GGUF").mkdir(parents=True)
    write_gguf(models / "odd-GGUF" / "odd-Q8_0.gguf", {"token_embd": Q.Q8_0}, arch="mamba")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


async def test_the_picker_lists_marks_refuses_and_switches(env, tmp_path, monkeypatch, tiny_llama):
    lm_studio(tmp_path, monkeypatch, tiny_llama)
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await pilot.press("f7")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.models)
        picker = app.screen
        listed = rows(picker)
        assert listed["acme/tiny-llama"] == " ✓"
        assert listed["acme/odd-GGUF/odd-Q8_0.gguf"] == " ✗"
        built = app.host.built
        picker.query_one("#name").value = "odd"
        await pilot.pause()
        assert list(rows(picker)) == ["acme/odd-GGUF/odd-Q8_0.gguf"]
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("architecture 'mamba'" in n for n, _ in app.notices))
        assert app.host.built is built  # nothing stopped
        picker.query_one("#name").value = "tiny-llama"
        await pilot.pause()
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.host.model_name == "acme/tiny-llama", 60)
        await wait_for(pilot, lambda: isinstance(app.screen, MainScreen))
        assert app.host.built is not built and not built.engine.running
        assert "acme/tiny-llama" in app.sub_title
        assert app.store.setting("model") == "acme/tiny-llama"
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "/max 3")
        await type_and_send(pilot, pane, "still here?")
        await wait_for(pilot, lambda: replied(pane, 2))
        await type_and_send(pilot, pane, "/model")  # alone: the picker, the running one marked
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.models)
        assert rows(app.screen)["acme/tiny-llama"] == "▶✓"
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MainScreen))
    # The next start without --model takes the model chosen last.
    host = EngineHost(None, "cpu", ["kv_pool_tokens=512"], http=False, remembered="acme/tiny-llama")
    host.start(lambda line: None)
    try:
        assert host.model_name == "acme/tiny-llama"
    finally:
        host.stop()


async def test_model_by_name_switches_and_a_bad_name_leaves_the_engine(
    env, tmp_path, monkeypatch, tiny_llama
):
    lm_studio(tmp_path, monkeypatch, tiny_llama)
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        built = app.host.built
        await type_and_send(pilot, pane, "/model nobody/nothing-here.gguf")
        await wait_for(pilot, lambda: any("Model switch failed" in n for n, _ in app.notices))
        assert app.host.built is built and built.engine.running
        await type_and_send(pilot, pane, "/model acme/tiny-llama")
        await wait_for(pilot, lambda: app.host.model_name == "acme/tiny-llama", 60)


async def test_the_picker_pulls_a_repository_by_name_then_loads_it(
    env, tmp_path, monkeypatch, tiny_llama
):
    from tests.fake_hub import FakeHub, FakeRepo

    lm_studio(tmp_path, monkeypatch, tiny_llama)
    types = {r: Q.Q8_0 for r in ("token_embd", "output", "attn_q", "attn_k", "attn_v")}
    model = write_gguf(tmp_path / "made" / "tiny-Q8_0.gguf", types)
    lines: list[str] = []
    with FakeHub() as hub:
        hub.add(FakeRepo("acme/tiny-GGUF", {"tiny-Q8_0.gguf": model.read_bytes()}))
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        app = make_app(env)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pilot.press("f7")
            await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen))
            picker = app.screen
            progress = picker.query_one("#progress")
            shown = progress.update

            def update(text):
                lines.append(str(text))
                return shown(text)

            progress.update = update
            picker.query_one("#name").value = "acme/tiny-GGUF:Q8_0"
            await pilot.pause()
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.host.model_name == "acme/tiny-GGUF:Q8_0", 60)
            await wait_for(pilot, lambda: isinstance(app.screen, MainScreen))
    assert any(line.startswith("downloading tiny-Q8_0.gguf: ") for line in lines)
    assert any("pulling acme/tiny-GGUF Q8_0" in line for line in lines)


def test_a_switch_that_fails_to_load_brings_the_old_model_back(tmp_path, monkeypatch, tiny_llama):
    from lucedesk.engine import QueueFullError
    from lucedesk.errors import LucedeskError, ModelLoadError
    from lucedesk.tui import engine_host

    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    host = EngineHost(str(tiny_llama), "cpu", ["kv_pool_tokens=512"], http=False)
    host.start(lambda line: None)
    real = engine_host.launch_engine

    def failing(path, config, *args, **kwargs):
        if str(path) == str(other):
            raise ModelLoadError("broken on purpose")
        return real(path, config, *args, **kwargs)

    try:
        monkeypatch.setattr(engine_host, "launch_engine", failing)
        with pytest.raises(LucedeskError, match="broken on purpose; the engine runs again"):
            host.switch("cpu", True, lambda line: None, model=str(other))
        assert host.built.engine.running and host.model_path == tiny_llama
        assert host.engine is host.built.engine

        def always(*args, **kwargs):
            raise ModelLoadError("nothing loads")

        monkeypatch.setattr(engine_host, "launch_engine", always)
        with pytest.raises(LucedeskError, match="no model runs now"):
            host.switch("cpu", True, lambda line: None, model=str(other))
        with pytest.raises(QueueFullError, match="no model runs: nothing loads"):
            host.engine  # noqa: B018 (the HTTP server and the panes read it so)
        monkeypatch.setattr(engine_host, "launch_engine", real)
        host.switch("cpu", True, lambda line: None, model=str(other))
        assert host.built.engine.running and host.stopped_because is None
    finally:
        host.stop()


async def test_the_log_view_shows_each_http_request(env):
    import httpx

    from lucedesk.tui.screens.log import LogScreen

    app = make_app(env, http=True)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("f9")
        await wait_for(pilot, lambda: isinstance(app.screen, LogScreen))
        async with httpx.AsyncClient() as client:
            ok = await client.get(app.host.url + "/v1/models")
            bad = await client.post(app.host.url + "/v1/chat/completions", json={"model": "x"})
        assert ok.status_code == 200 and bad.status_code in (400, 404, 422)

        def shown() -> str:
            return "\n".join(str(line.text) for line in app.screen.query_one("RichLog").lines)

        await wait_for(pilot, lambda: "GET /v1/models 200" in shown())
        await wait_for(pilot, lambda: f"POST /v1/chat/completions {bad.status_code}" in shown())
        assert any("GET /v1/models 200" in line for line in app.kept_log.lines)
