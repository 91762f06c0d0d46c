"""The TUI as a daily driver, driven by Textual's pilot with keys sent while the input has
the focus: every advertised key, tool blocks folded, true rates, an atomic profile switch,
marks that survive a reload, exports with tool calls, the key overlay, focus and drafts,
following output, tidy sessions, /tool-choice and the fan-out wording."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from textual.widgets import Input, Static

from lucedesk.agent import Runtime
from lucedesk.tui.screens.keys import KeysScreen, key_name, key_rows
from lucedesk.tui.screens.main import MainScreen
from lucedesk.tui.slash import COMMANDS
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.chat_pane import WELCOME
from lucedesk.tui.widgets.engine_status import EngineStatus
from lucedesk.tui.widgets.message_view import MessageView
from lucedesk.tui.widgets.session_list import MARKS, MEANINGS, SessionList
from lucedesk.tui.widgets.tool_call_view import ToolCallView
from tests.test_agent_loop import Reply, ScriptedBackend, call
from tests.test_tui import (
    SIZE,
    choose_profile,
    make_app,
    prepare,
    replied,
    started,
    type_and_send,
    wait_for,
)

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture
def env(tmp_path, monkeypatch, tiny_llama):
    return prepare(tmp_path, monkeypatch, tiny_llama)


def scripted(app, script) -> ScriptedBackend:
    """The app's local sessions answered by `script` (on the app's own engine)."""
    backend = ScriptedBackend(app.host.engine, [1, 2, 3], script)
    agents = app.agents
    agents.runtimes[""] = Runtime(
        backend, app.store, agents.approvals, [], agents.observe, watched=agents.watched
    )
    return backend


def main_keys() -> list[tuple[str, str]]:
    """The main screen's keys as the key overlay lists them."""
    return key_rows(MainScreen.BINDINGS)


def notices(app) -> str:
    return " | ".join(text for text, _ in app.notices)


def test_the_readmes_key_table_is_what_the_keys_do():
    """Every key the README lists is bound to what it says, and every binding is listed."""
    section = README.read_text().split("## TUI keys", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    listed = " ".join(rows[1:])  # after the header row
    for keys, action in main_keys():
        for key in keys.split(" / "):
            assert key in listed, f"README's key table lacks {key} ({action})"
    for key in re.findall(r"(?:Ctrl\+\w|F\d+|Esc)\b", listed):
        in_input = " ".join(key_name(b.key) for b in ChatInput.BINDINGS)
        bound = " ".join(k for k, _ in main_keys()) + f" Ctrl+J Ctrl+P Shift+Enter Enter {in_input}"
        assert key in bound, f"README lists {key}, which nothing binds"
    for command in COMMANDS:
        assert f"/{command.name}" in README.read_text(), f"README lacks /{command.name}"


async def test_advertised_keys_work_while_the_input_has_the_focus(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        first = screen.panes[0]
        assert WELCOME in str(first.query_one("#welcome", Static).render())
        box = first.query_one(ChatInput)
        box.focus()
        await pilot.press(*"half typed")
        await pilot.press("ctrl+s")  # split
        await wait_for(pilot, lambda: len(screen.panes) == 2)
        second = screen.panes[1]
        assert app.focused is second.query_one(ChatInput)
        await pilot.press("f6")  # back to the first pane: its text kept, not selected
        assert app.focused is box and box.text == "half typed" and not box.selected_text
        await pilot.press("x")
        assert box.text == "half typedx"
        await pilot.press("f6")
        await pilot.press("ctrl+w")  # closes the focused (second) pane
        await wait_for(pilot, lambda: len(screen.panes) == 1)
        assert screen.panes == [first] and box.text == "half typedx"
        box.focus()
        await pilot.press("ctrl+y")
        assert "No reply to copy yet." in notices(app)
        await pilot.press("ctrl+e")
        await wait_for(pilot, lambda: "Exported to" in notices(app))
        exported = Path(notices(app).split("Exported to ")[1].split(" | ")[0])
        assert exported.parent == Path(os.environ["LUCEDESK_DATA_DIR"]) / "exports"
        # F1 lists every key and command, from the bindings themselves
        await pilot.press("f1")
        assert isinstance(app.screen, KeysScreen)
        shown = app.screen.text()
        for keys, action in main_keys():
            assert keys in shown and action in shown
        for command in COMMANDS:
            assert f"/{command.name}" in shown
        for status, mark in MARKS.items():  # the sidebar's legend
            assert f"{mark}" in shown and MEANINGS[status] in shown
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen) and app.focused is box
        # Ctrl+B folds the sidebar away and back
        sidebar = screen.query_one(SessionList)
        box.focus()
        await pilot.press("ctrl+b")
        assert not sidebar.display
        await pilot.press("ctrl+b")
        assert sidebar.display
        assert box.text == "half typedx"  # nothing typed was lost on the way
        await type_and_send(pilot, first, "/help")
        assert isinstance(app.screen, KeysScreen)
        await pilot.press("escape")


async def test_tool_blocks_are_one_line_and_export_with_their_calls(env):
    app = make_app(env, tools="general")
    (env[0] / "workspace" / "notes.txt").write_text("a note\n")

    def script(req):
        done = sum(1 for m in req.messages if m.role == "tool")
        if done < 2:
            return Reply(calls=(call("read_file", {"path": "notes.txt"}),))
        return Reply("both read", tokens=900)  # running until Esc

    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        scripted(app, script)
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "read the notes twice")
        await wait_for(pilot, lambda: len(pane.query(ToolCallView)) == 2)
        await pilot.pause(0.2)
        # while the session still runs: each block one line, folded
        assert pane.busy
        assert [v.region.height for v in pane.query(ToolCallView)] == [1, 1]
        await pilot.press("escape")
        await wait_for(pilot, lambda: not pane.busy)
        await pilot.pause(0.2)
        assert [v.region.height for v in pane.query(ToolCallView)] == [1, 1]
        assert all(v.collapsed for v in pane.query(ToolCallView))
        path = pane.export()
        text = path.read_text()
        assert text.count("### tool call · read_file") == 2
        assert '{"path": "notes.txt"}' in text and "a note" in text
        assert "- calls `read_file`" in text and "both read" in text
        # the status line's rate falls to 0 once nothing runs
        status = screen.query_one(EngineStatus)
        await wait_for(pilot, lambda: "· 0.0 tok/s" in status.shown, 5)


async def test_sessions_stay_tidy_and_come_back_as_they_were(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+n")  # two new chats never used: nothing stored for them
        await type_and_send(pilot, pane, "/max 900")
        await type_and_send(pilot, pane, "What is the tallest mountain on the planet Earth")
        assert pane.session.title == "What is the tallest mountain on the pla…"
        await wait_for(pilot, lambda: len(pane.session.messages[-1].content) > 20)
        await pilot.press("escape")  # stopped mid-reply
        await wait_for(pilot, lambda: not pane.busy)
        stopped = pane.session.messages[-1].content
        await type_and_send(pilot, pane, "/max 8")
        await pilot.press("ctrl+r")  # a new reply; the stopped one set aside
        await wait_for(pilot, lambda: replied(pane, 2) and not pane.busy)
        assert pane.session.messages[-1].content != stopped
        await type_and_send(pilot, pane, "/undo")
        assert pane.session.messages[-1].content == stopped
        # a second pane with its own chat, then a draft left in the first
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: len(screen.panes) == 2)
        other = screen.panes[1]
        await type_and_send(pilot, other, "/max 4")
        await type_and_send(pilot, other, "second chat")
        await wait_for(pilot, lambda: replied(other, 2) and not other.busy)
        kept = (pane.session.id, other.session.id)
        sessions = app.store.sessions()
        assert [s.id for s in sessions] == list(kept)  # no empty "New chat" stored
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await wait_for(pilot, lambda: len(screen.panes) == 2)
        assert tuple(p.session.id for p in screen.panes) == kept
        assert app.focused is screen.panes[1].query_one(ChatInput)  # the focus as it was
        pane = screen.panes[0]
        titles = [str(v.query_one("Label").render()) for v in pane.query(MessageView)]
        assert titles[-1] == "assistant · stopped"  # the mark survives the reload
        stopped = pane.session.messages[-1].content
        # /continue writes on in the same message (after a restart too), ending as any reply
        count = len(pane.session.messages)
        await type_and_send(pilot, pane, "/continue")
        await wait_for(pilot, lambda: not pane.busy and pane.session.status == "done")
        assert len(pane.session.messages) == count
        continued = pane.session.messages[-1]
        assert continued.content.startswith(stopped.rstrip())
        assert len(continued.content) > len(stopped.rstrip())
        assert "stopped" not in continued.meta()
        await type_and_send(pilot, pane, "/undo")
        assert "no reply was replaced here" in notices(app)
        assert pane.query_one(ChatInput).text == "/undo"  # a failed command stays to edit
        pane.query_one(ChatInput).clear()
        await pilot.pause(0.2)
        titles = [str(v.query_one("Label").render()) for v in pane.query(MessageView)]
        assert titles[-1] == "assistant · max tokens"
        # a draft belongs to its session: switching the pane away and back keeps it
        box = pane.query_one(ChatInput)
        box.focus()
        await pilot.press(*"unsent words")
        await pilot.press("ctrl+n")  # a new chat in this pane: an empty input
        assert box.text == "" and pane.session.id not in kept
        tree = screen.query_one(SessionList)
        tree.focus()
        tree.move_cursor(tree.node_of(kept[0]))
        await pilot.press("enter")
        await wait_for(pilot, lambda: pane.session.id == kept[0])
        assert box.text == "unsent words"
        # a click on the transcript keeps the typing in the input
        await pilot.click(MessageView)
        await pilot.press("o", "k")
        assert box.text.endswith("unsent wordsok")
        # rename and delete from the sidebar
        tree.focus()
        tree.move_cursor(tree.node_of(kept[1]))
        await pilot.press("r")
        field = app.screen.query_one(Input)
        field.value = "renamed chat"
        await pilot.press("enter")
        await pilot.pause()
        assert app.store.session(kept[1]).title == "renamed chat"
        assert "renamed chat" in str(tree.node_of(kept[1]).label)
        tree.focus()
        tree.move_cursor(tree.node_of(kept[1]))
        await pilot.press("delete")
        await pilot.click("Button#delete")
        await wait_for(pilot, lambda: app.store.session(kept[1]) is None)
        assert tree.node_of(kept[1]) is None
        assert screen.panes[1].session.id != kept[1] and screen.panes[1].session.messages == []


async def test_a_failed_profile_switch_leaves_the_engine_as_it_was(env):
    app = make_app(env)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await started(pilot)
        built, stats = app.host.built, app.host.engine.stats()
        subtitle = app.sub_title
        await choose_profile(pilot, "cuda")
        question = app.screen.query_one("Label")
        assert question.region.height >= 2  # wrapped, not clipped
        await pilot.click("Button#finish")
        await wait_for(pilot, lambda: "Switch to cuda failed" in notices(app))
        assert "sees no GPU" in notices(app)
        assert app.host.built is built and app.host.profile.name == "cpu"
        assert app.host.engine.stats().blocks_total == stats.blocks_total
        assert app.sub_title == subtitle
        await pilot.press("escape")
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "/max 4")
        await type_and_send(pilot, pane, "still there?")
        await wait_for(pilot, lambda: replied(pane, 2))


async def test_tool_choice_phases_and_fanout_limits(env):
    phases: list[str] = []
    app = make_app(env, slots=16, tools="general")
    observe = app.agents.observe

    def watching(event):
        phase = getattr(event, "session", None)
        if type(event).__name__ == "PhaseChanged":
            phases.append(phase.phase)
        observe(event)

    app.agents.observe = watching
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        backend = scripted(app, lambda req: Reply("fine", tokens=6))
        app.agents.runtimes[""].observer = watching
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "/fanout 20 many things")
        assert "at most 8 subagents (the engine has 16 slots)" in notices(app)
        await type_and_send(pilot, pane, "/tool-choice read_nothing")
        assert "no tool 'read_nothing'" in notices(app) and "read_file" in notices(app)
        await type_and_send(pilot, pane, "/tool-choice none")
        await type_and_send(pilot, pane, "answer in words")
        await wait_for(pilot, lambda: replied(pane, 2) and not pane.busy)
        await type_and_send(pilot, pane, "and again")
        await wait_for(pilot, lambda: replied(pane, 4) and not pane.busy)
        assert [r.tool_choice.mode for _, r in backend.requests] == ["none", "auto"]
        assert all(r.interactive for _, r in backend.requests)  # the focused pane's: watched
        assert "reading" in phases and "writing" in phases
        await type_and_send(pilot, pane, "/tools read")
        assert "has no tool-call format of its own" in notices(app)


async def test_the_transcript_follows_output_unless_scrolled_up(env):
    app = make_app(env)
    words = " ".join(f"word{i}" for i in range(300))
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await started(pilot)
        scripted(app, lambda req: Reply(words, tokens=900))
        pane = screen.panes[0]
        log = pane.log_view
        marker = pane.query_one("#new-below")
        await type_and_send(pilot, pane, "talk")
        await wait_for(pilot, lambda: log.max_scroll_y > 10)
        await pilot.pause(0.3)
        assert log.scroll_y >= log.max_scroll_y - 1 and not marker.display  # following
        log.scroll_home(animate=False)
        await wait_for(pilot, lambda: marker.has_class("shown"))  # more came below
        await pilot.pause(0.3)
        assert log.scroll_y == 0  # left where the user put it
        await pilot.click("#new-below")
        await wait_for(pilot, lambda: log.scroll_y >= log.max_scroll_y - 1)
        assert not marker.has_class("shown") and log.following
        assert app.focused is pane.query_one(ChatInput)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not pane.busy)
