"""The TUI driven by Textual's pilot, on a tiny random model."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from textual.widgets import Label, TextArea

from lucedesk.agent import AgentSession, Approvals
from lucedesk.agent import children as agent_children
from lucedesk.engine.runner import TorchSeqEngine
from lucedesk.store import Store, StoredMessage
from lucedesk.tui.app import LucedeskApp
from lucedesk.tui.engine_host import EngineHost
from lucedesk.tui.screens.dialogs import SplitDialog
from lucedesk.tui.screens.main import MainScreen
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.chat_pane import ChatPane
from lucedesk.tui.widgets.message_view import MessageView
from lucedesk.tui.widgets.session_list import SessionList
from lucedesk.tui.widgets.slot_monitor import SlotMonitor

SIZE = (140, 44)
DECODING: list[set[str]] = []


def decoded_together(*prefixes: str) -> bool:
    """Some step decoded a row of every owner starting with each prefix."""
    return any(all(any(o.startswith(p) for o in step) for p in prefixes) for step in DECODING)


@pytest.fixture
def env(tmp_path, monkeypatch, tiny_llama):
    return prepare(tmp_path, monkeypatch, tiny_llama)


def prepare(tmp_path, monkeypatch, tiny_llama):
    # Profiles, sessions and exports all under the test's own folders.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DOCUMENTS_DIR", str(tmp_path / "docs"))
    # A random model emits its end token at random; replies here run to their max tokens.
    turn_request = AgentSession.turn_request

    def running_on(self, *args):
        req = turn_request(self, *args)
        req.sampling.ignore_eos = True
        return req

    monkeypatch.setattr(AgentSession, "turn_request", running_on)
    # The tiny model needs ~1 ms a step; 20 ms more keeps replies running long enough to watch.
    # Each step's decoding owners are recorded, so tests can tell what ran at the same time.
    execute = TorchSeqEngine.execute

    def slowed(self, plan):
        DECODING.append({row.request.owner for row in plan.decodes})
        time.sleep(0.02)
        return execute(self, plan)

    DECODING.clear()
    monkeypatch.setattr(TorchSeqEngine, "execute", slowed)
    return tmp_path, tiny_llama


def make_app(
    env,
    http: bool = False,
    slots: int = 4,
    extra: tuple[str, ...] = (),
    tools: str = "chat",
    approvals: Approvals | None = None,
) -> LucedeskApp:
    """The app on the tiny model; new sessions are plain chats (`tools`="chat") unless a test
    gives them tools, working in the test's folder."""
    tmp, model = env
    host = EngineHost(
        str(model),
        "cpu",
        [f"max_slots={slots}", "kv_pool_tokens=8192", "max_model_len=1024", *extra],
        http=http,
        port=0,
    )
    workspace = tmp / "workspace"
    workspace.mkdir(exist_ok=True)
    app = LucedeskApp(host, Store(tmp / "sessions.db"), workspace, tools, approvals or Approvals())
    app.notices = []
    real_notify = app.notify

    def notify(message, *args, **kwargs):
        app.notices.append((str(message), kwargs.get("severity", "information")))
        return real_notify(message, *args, **kwargs)

    app.notify = notify
    return app


async def wait_for(pilot, predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.05)


async def started(pilot) -> MainScreen:
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, MainScreen))
    await wait_for(pilot, lambda: bool(pilot.app.screen.panes))
    await pilot.pause(0.1)  # let the header finish mounting before a test can end the app
    return pilot.app.screen


async def choose_profile(pilot, name: str) -> None:
    """F8, then Enter on profile `name`: its confirmation dialog is up."""
    await pilot.press("f8")
    await pilot.pause()
    table = pilot.app.screen.query_one("DataTable")
    names = [table.get_row_at(i)[1] for i in range(table.row_count)]
    table.move_cursor(row=names.index(name))
    await pilot.press("enter")
    await pilot.pause()


async def type_and_send(pilot, pane: ChatPane, text: str) -> None:
    box = pane.query_one(ChatInput)
    box.focus()
    box.text = text
    await pilot.press("enter")
    await pilot.pause()


async def ask_for_a_long_reply(pilot, pane: ChatPane) -> None:
    """A reply of up to 900 tokens (a random model's run to their max): time to watch it."""
    await type_and_send(pilot, pane, "/max 900")
    await type_and_send(pilot, pane, "a long answer please")


def replied(pane: ChatPane, count: int, spoken: bool = False) -> bool:
    """The session holds `count` messages (`spoken`: not counting compactions) and no reply
    is still being written (a reply is stored from its first token on)."""
    messages = pane.session.messages
    if spoken:
        messages = [m for m in messages if m.role != "compaction"]
    return len(messages) == count and not pane.busy and messages[-1].status == "done"


def decoding(app) -> int:
    return sum(s.phase == "decode" for s in app.host.engine.stats().slots)


async def test_two_panes_generate_at_once(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        first = screen.panes[0]
        await type_and_send(pilot, first, "/max 900")
        await type_and_send(pilot, first, "tell me everything")
        await pilot.press("ctrl+s")
        await pilot.pause()
        second = screen.panes[1]
        await type_and_send(pilot, second, "/max 900")
        await type_and_send(pilot, second, "and you too")
        await pilot.press("ctrl+g")
        monitor = screen.query_one(SlotMonitor)
        await wait_for(pilot, lambda: decoding(app) == 2)
        assert decoded_together(first.agent.owner, second.agent.owner)
        monitor.refresh_stats()
        table = monitor.query_one("DataTable")
        phases = [table.get_row_at(i)[2] for i in range(table.row_count)]
        owners = {table.get_row_at(i)[1] for i in range(table.row_count)}
        assert phases.count("decode") == 2
        # each was sent from the focused pane: watched, marked »
        assert {f"» {first.agent.owner}", f"» {second.agent.owner}"} <= owners
        await pilot.press("escape")  # the focused pane (the second) stops
        await wait_for(pilot, lambda: not second.busy)
        assert first.busy
        first.stop()
        await wait_for(pilot, lambda: not first.busy and not second.busy)


async def test_escape_mid_reply_frees_the_slot(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await ask_for_a_long_reply(pilot, pane)
        await wait_for(pilot, lambda: decoding(app) == 1)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not pane.busy)
        stats = app.host.engine.stats()
        await wait_for(pilot, lambda: app.host.engine.stats().blocks_used == 0)
        assert stats.num_running == 0
        assert pane.session.messages[-1].role == "assistant"


async def test_fanout_splits_runs_children_at_once_then_synthesizes(env, monkeypatch):
    # A random model writes its strings to their longest: short ones keep the split quick.
    monkeypatch.setattr(agent_children, "SUBTASK_TITLE_CHARS", 8)
    monkeypatch.setattr(agent_children, "SUBTASK_CHARS", 24)
    app = make_app(env, slots=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "/max 40")
        await type_and_send(pilot, pane, "/fanout 3 list some ideas")
        # The split is shown before anything runs; edited here (e, then Esc ends editing).
        await wait_for(pilot, lambda: isinstance(app.screen, SplitDialog), 60)
        dialog = app.screen
        assert len(dialog.subtasks) == 3 and not app.store.sessions("subagent")
        await pilot.press("e")
        await pilot.pause()
        dialog.query_one(TextArea).text = "## first\nfruit\n\n## second\ntools\n\n## third\nbirds"
        await pilot.press("escape")
        await pilot.pause()
        assert [t["title"] for t in dialog.subtasks] == ["first", "second", "third"]
        await pilot.press("enter")
        # the split (3 task calls), 3 results, the synthesis
        await wait_for(pilot, lambda: replied(pane, 6), 90)
        children = [s for s in app.store.sessions("subagent") if s.parent_id == pane.session.id]
        assert sorted(c.title for c in children) == ["first", "second", "third"]
        # the user's own line is shown; the model read the split prompt
        assert pane.session.messages[0].content == "/fanout 3 list some ideas"
        assert "3 distinct" in pane.session.chat_messages()[0].content
        assert decoded_together(*(app.agents.live[c.id].owner for c in children))
        split, *results, synthesis = pane.session.messages[1:]
        assert [c["name"] for c in split.meta()["tool_calls"]] == ["task"] * 3
        shown = [v.content for v in pane.query(MessageView) if v.role == "assistant"]
        assert "Split into 3 subtasks:\n\n## first\nfruit" in shown[0]  # its JSON, replaced
        assert [r.role for r in results] == ["tool"] * 3
        assert all(not r.meta()["error"] for r in results)
        assert synthesis.role == "assistant" and synthesis.status == "done"
        # The sidebar shows the children under their parent.
        tree = screen.query_one(SessionList)
        parent = tree.node_of(pane.session.id)
        assert sorted(n.data for n in parent.children) == sorted(c.id for c in children)
        # The parent continues from the synthesis.
        await type_and_send(pilot, pane, "/max 5")
        await type_and_send(pilot, pane, "summarize")
        # (the random results fill the 1,024-token context: a compaction may come first)
        await wait_for(pilot, lambda: replied(pane, 8, spoken=True))


async def test_bad_input_gets_notices(env):
    app = make_app(env, slots=2)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        for line in [
            "   ",
            "/nope",
            "/fanout 0 x",
            "/fanout 3 too many",
            "/fanout 2",
            "/temp hot",
            "/max -4",
        ]:
            await type_and_send(pilot, pane, line)
        severities = [sev for _, sev in app.notices]
        texts = " | ".join(t for t, _ in app.notices)
        assert "Type a message first" in texts and "Unknown command /nope" in texts
        assert texts.count("N must be between 1 and 2: the engine has 2 slots") == 2
        assert "say what the subagents should do" in texts
        assert "/temp: expected a number, got 'hot'" in texts
        assert "/max: max tokens must be at least 1" in texts
        assert severities.count("error") >= 6
        assert app.host.engine.running and pane.session.messages == []


async def test_sessions_survive_a_restart(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "/max 8")
        await type_and_send(pilot, pane, "/title remembered")
        await type_and_send(pilot, pane, "hello there")
        await wait_for(pilot, lambda: replied(pane, 2))
        assert pane.session.messages[-1].status == "done"
        reply = pane.session.messages[-1].content
    again = make_app(env)
    async with again.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        assert pane.session.title == "remembered" and pane.session.max_tokens == 8
        assert [m.content for m in pane.session.messages] == ["hello there", reply]
        assert [n.data for n in screen.query_one(SessionList).all_nodes()] == [pane.session.id]


async def test_http_request_shows_in_monitor(env):
    app = make_app(env, http=True)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        url = app.host.url
        assert url and url in app.sub_title

        seen = threading.Event()

        def call():
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                timeout=60,
                json={"prompt": "hi", "max_tokens": 900, "stream": True, "ignore_eos": True},
                headers={"X-Lucedesk-Client": "my-editor"},
            ) as r:
                for _ in r.iter_lines():
                    if seen.is_set():
                        break  # hanging up cancels the request

        task = asyncio.get_running_loop().run_in_executor(None, call)
        await wait_for(
            pilot, lambda: any(s.owner == "http:my-editor" for s in app.host.engine.stats().slots)
        )
        await pilot.press("ctrl+g")
        monitor = app.screen.query_one(SlotMonitor)
        monitor.refresh_stats()
        table = monitor.query_one("DataTable")
        owners = {table.get_row_at(i)[1] for i in range(table.row_count)}
        seen.set()
        await task
        assert "http:my-editor" in owners


async def test_profile_switch_rebuilds_engine_and_keeps_chats(env):
    tmp, _ = env
    user_profiles = tmp / "config" / "lucedesk" / "profiles"
    user_profiles.mkdir(parents=True)
    (user_profiles / "tiny.toml").write_text(
        'description = "small test profile"\n[match]\nbackend = "cpu"\n'
        "[engine]\nprefill_chunk_idle = 64\nmax_num_batched_tokens = 64\n"
    )
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "/max 300")
        await type_and_send(pilot, pane, "keep going")
        await wait_for(pilot, lambda: decoding(app) == 1)
        old_engine = app.host.engine
        await choose_profile(pilot, "tiny")
        await pilot.click("Button#dismiss")  # first: back out of the dialog
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        await pilot.click("Button#finish")
        await wait_for(pilot, lambda: app.host.profile.name == "tiny", 60)
        assert app.host.engine is not old_engine and not old_engine.running
        config = app.host.engine.scheduler.config
        assert config.prefill_chunk_idle == 64  # from the new profile
        assert config.max_slots == 4  # the command line's overrides still apply
        assert "profile tiny" in app.sub_title
        await pilot.press("escape")
        await wait_for(pilot, lambda: not pane.busy)
        # The reply in flight was finished under the old engine, and the chat is intact.
        assert [m.role for m in pane.session.messages] == ["user", "assistant"]
        await type_and_send(pilot, pane, "/max 4")
        await type_and_send(pilot, pane, "still here?")
        await wait_for(pilot, lambda: replied(pane, 4))


async def test_session_on_a_remote_server(env, tiny_llama):
    import torch

    from lucedesk.engine.models.loader import load_model
    from lucedesk.server import create_app, start_server
    from tests.engine_harness import make_engine

    far = make_engine(
        load_model(tiny_llama, torch.float32), max_slots=2, kv_pool_tokens=2048
    ).start()
    running = start_server(create_app(far, model_name="far"), "127.0.0.1", 0)
    app = make_app(env)
    try:
        async with app.run_test(size=SIZE) as pilot:
            screen = await started(pilot)
            pane = screen.panes[0]
            await type_and_send(pilot, pane, "/backend ftp://nowhere")
            assert "http(s) URL" in app.notices[-1][0]
            await type_and_send(pilot, pane, "/max 6")
            await type_and_send(pilot, pane, "hello from here")
            await wait_for(pilot, lambda: replied(pane, 2))
            await type_and_send(pilot, pane, f"/backend {running.url}")
            await type_and_send(pilot, pane, "hello from afar")
            await wait_for(pilot, lambda: replied(pane, 4))
            # counted on the far engine's thread once its stream is sent: soon after
            await wait_for(pilot, lambda: far.stats().num_completed == 1)
            assert app.host.engine.stats().num_completed == 1  # the first, before /backend
            await pilot.press("ctrl+g")
            label = screen.query_one("#remote")
            await wait_for(pilot, lambda: "slots busy" in str(label.render()))
        again = make_app(env)
        async with again.run_test(size=SIZE) as pilot:
            screen = await started(pilot)
            assert screen.panes[0].session.backend_url == running.url  # remembered
    finally:
        running.stop()
        far.shutdown()


async def test_model_switch_keeps_chats(env, tiny_models):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "/max 4")
        await type_and_send(pilot, pane, "first")
        await wait_for(pilot, lambda: replied(pane, 2))
        await type_and_send(pilot, pane, "/model /no/such/model.gguf")
        await wait_for(pilot, lambda: any("Model switch failed" in t for t, _ in app.notices))
        assert app.host.built.loaded.name == "llama" and app.host.engine.running
        await type_and_send(pilot, pane, f"/model {tiny_models['qwen3']}")
        await wait_for(pilot, lambda: app.host.built.loaded.name == "qwen3", 60)
        await type_and_send(pilot, pane, "second")
        await wait_for(pilot, lambda: replied(pane, 4))
        assert pane.session.messages[0].content == "first"


async def test_a_reply_is_saved_while_it_streams(env):
    """The store holds the reply so far, not only at its end: a crash mid-reply (see
    test_store_crash.py) keeps what was shown."""
    import sqlite3

    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await ask_for_a_long_reply(pilot, pane)

        def saved() -> tuple[str, str] | None:
            with sqlite3.connect(env[0] / "sessions.db") as db:
                row = db.execute(
                    "SELECT status, content FROM messages WHERE role = 'assistant' "
                    "ORDER BY id DESC LIMIT 1"
                ).fetchone()
            return row

        await wait_for(pilot, lambda: (row := saved()) is not None and len(row[1]) > 0)
        assert saved()[0] == "streaming" and pane.busy
        await pilot.press("escape")
        await wait_for(pilot, lambda: not pane.busy)
        status, content = saved()
        assert status == "done" and content == pane.session.messages[-1].content


async def test_a_reply_cut_by_a_crash_shows_as_interrupted(env):
    """A reply still streaming when the process died comes back marked interrupted."""
    store = Store(env[0] / "sessions.db")
    session = store.create_session("before the crash")
    store.add_message(session, StoredMessage("user", "tell me a story"))
    store.update_reply(store.begin_reply(session), "Once upon a")  # then: kill -9
    store.close()
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        assert [m.status for m in pane.session.messages] == ["done", "interrupted"]
        labels = [str(label.render()) for label in pane.query("MessageView Label")]
        assert labels[-1] == "assistant · interrupted"


async def test_quitting_while_a_reply_streams_exits_cleanly(env):
    # Quitting mid-reply stops the agent, and its last word on the reply ("stopped") can
    # reach the view while the app is taking the view's parts down. That order, made certain
    # here: the title gone first, then the app quitting, then the reply's end.
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await ask_for_a_long_reply(pilot, pane)

        def streaming() -> MessageView | None:
            views = [v for v in pane.query(MessageView) if v.role == "assistant" and v.content]
            return views[0] if views else None

        await wait_for(pilot, lambda: streaming() is not None)
        view = streaming()
        await view.query_one(Label).remove()
        app.exit()
        await view.finish("stopped")
    assert app.return_code == 0
