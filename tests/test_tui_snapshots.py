"""Snapshots of the TUI at fixed terminal sizes: the main screen, the split view, the monitor,
tool blocks and an approval dialog, with nothing generating (so every frame is
reproducible)."""

from __future__ import annotations

import pytest

from lucedesk.agent import Runtime
from lucedesk.tui.screens.approval import ApprovalDialog
from lucedesk.tui.widgets.tool_call_view import ToolCallView
from tests.test_agent_loop import Reply, ScriptedBackend, call
from tests.test_tui import make_app, prepare, started, type_and_send, wait_for

SIZE = (120, 34)


@pytest.fixture
def app(tmp_path, monkeypatch, tiny_llama):
    # torch kernels: the header names the kernels, and the cpu ones depend on the machine.
    env = prepare(tmp_path, monkeypatch, tiny_llama)
    return make_app(env, slots=4, extra=("kernels=torch",))


async def steady(pilot) -> None:
    """A blinking text cursor would make frames differ: take the focus off the inputs."""
    pilot.app.screen.set_focus(None)
    await pilot.pause(0.1)


async def _main(pilot) -> None:
    await started(pilot)
    await steady(pilot)


async def _split(pilot) -> None:
    await started(pilot)
    await pilot.press("ctrl+s")
    await steady(pilot)


async def _monitor(pilot) -> None:
    await started(pilot)
    await pilot.press("ctrl+g")
    await pilot.pause(1.2)  # the refresh on opening and one tick of the 1 Hz timer
    await steady(pilot)


def test_main_screen(snap_compare, app):
    assert snap_compare(app, terminal_size=SIZE, run_before=_main)


def test_split_view(snap_compare, app):
    assert snap_compare(app, terminal_size=SIZE, run_before=_split)


def test_slot_monitor(snap_compare, app):
    assert snap_compare(app, terminal_size=SIZE, run_before=_monitor)


# -- at the sizes people run it: tool blocks, the monitor line, an approval dialog ----------

SIZES = {"100x30": (100, 30), "170x45": (170, 45)}


@pytest.fixture
def agent_app(tmp_path, monkeypatch, tiny_llama):
    env = prepare(tmp_path, monkeypatch, tiny_llama)
    (tmp_path / "workspace").mkdir()
    (tmp_path / "workspace" / "notes.txt").write_text("a note\nand a second line\n")
    return make_app(env, slots=4, extra=("kernels=torch",), tools="general")


def reads_then_writes(req):
    done = sum(1 for m in req.messages if m.role == "tool")
    if done == 0:
        return Reply(calls=(call("read_file", {"path": "notes.txt"}),))
    if done == 1:
        return Reply(calls=(call("list_dir", {"path": "."}),))
    if done == 2:
        return Reply(calls=(call("write_file", {"path": "new.txt", "content": "hello\n"}),))
    return Reply("Done.")


async def _until_approval(pilot) -> None:
    screen = await started(pilot)
    app = pilot.app
    agents = app.agents
    backend = ScriptedBackend(app.host.engine, [1, 2, 3], reads_then_writes)
    agents.runtimes[""] = Runtime(backend, app.store, agents.approvals, [], agents.observe)
    pane = screen.panes[0]
    await type_and_send(pilot, pane, "look, then write")
    await wait_for(pilot, lambda: isinstance(app.screen, ApprovalDialog))
    # the pane behind shows the call waiting for its answer, on one line
    views = list(pane.query(ToolCallView))
    assert len(views) == 3 and "running…" in str(views[-1].title)
    assert [v.region.height for v in views] == [1, 1, 1]
    # rates over the last 2 s are 0 from here on, and the 2 Hz status line shows it
    await pilot.pause(2.8)
    for screen in app.screen_stack:  # the pane's input behind the dialog blinks too
        screen.set_focus(None)
    await pilot.pause(0.1)


async def _tool_blocks(pilot) -> None:
    await _until_approval(pilot)
    await pilot.press("n")  # denied: the model's last turn answers
    pane = pilot.app.screen.panes[0]
    await wait_for(pilot, lambda: not pane.busy)
    await pilot.pause(2.8)  # the monitor opens on an idle engine: its rate history is flat
    await pilot.press("ctrl+g")
    await pilot.pause(1.2)
    await steady(pilot)


@pytest.mark.parametrize("size", SIZES)
def test_tool_blocks_and_monitor_line(snap_compare, agent_app, size):
    assert snap_compare(agent_app, terminal_size=SIZES[size], run_before=_tool_blocks)


@pytest.mark.parametrize("size", SIZES)
def test_approval_dialog(snap_compare, agent_app, size):
    assert snap_compare(agent_app, terminal_size=SIZES[size], run_before=_until_approval)
