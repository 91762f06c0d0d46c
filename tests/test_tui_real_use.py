"""The TUI under a daily user's hands, on the pilot: panes closed while they stream, a restart
that keeps each pane's session and focus together, a new chat in the sidebar from its first
reply, small screens, pasted lines, keys right after F6, a quick quit, and the other
rough edges found by hand."""

from __future__ import annotations

import asyncio
import gc
import random
import warnings

import pytest
from textual.geometry import Region

from lucedesk.tui.messages import PromptSubmitted
from lucedesk.tui.widgets.chat_input import ChatInput
from tests.test_tui import (
    SIZE,
    decoding,
    make_app,
    prepare,
    started,
    wait_for,
)


@pytest.fixture
def env(tmp_path, monkeypatch, tiny_llama):
    return prepare(tmp_path, monkeypatch, tiny_llama)


async def long_reply(pane) -> None:
    """A reply of up to 900 tokens started in `pane` as Enter starts one, without a key press
    (the pilot's press waits for an idle app, which a streaming one never is)."""
    pane.session.max_tokens = 900
    await pane.send("a long answer please")


async def short_reply(pilot, pane, text: str) -> None:
    """A message answered in two tokens, waited for to its end."""
    pane.session.max_tokens = 2
    count = len(pane.session.messages)
    await pane.send(text)
    await wait_for(pilot, lambda: len(pane.session.messages) == count + 2 and not pane.busy)


async def press_soon(pilot, *keys: str) -> None:
    """Keys pressed without waiting for the app to be idle (a streaming reply never is)."""
    task = asyncio.ensure_future(pilot.press(*keys))
    await asyncio.sleep(0)
    await asyncio.wait({task}, timeout=5)


async def test_closing_panes_while_they_stream_never_crashes(env):
    app = make_app(env)
    rng = random.Random(0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        for _ in range(8):
            while len(screen.panes) < 2:
                await screen.run_action("split")
                await pilot.pause()
            for pane in screen.panes:
                if not pane.busy:
                    await long_reply(pane)
            await wait_for(pilot, lambda: all(p.busy for p in screen.panes))
            await pilot.pause(rng.uniform(0.0, 0.3))
            closed = screen.pane()
            await press_soon(pilot, "ctrl+w")
            await wait_for(pilot, lambda c=closed: c not in screen.panes)
            await pilot.pause(rng.uniform(0.0, 0.2))
        for pane in screen.panes:
            pane.stop()
        await wait_for(pilot, lambda: not any(p.busy for p in screen.panes))
        assert app.return_code is None  # running, never crashed


async def test_a_closed_panes_input_drawn_late_is_blank(env):
    """A refresh begun before a pane closed can draw its input after the removal, when the
    input has lost its styles: that draw is blank, not a KeyError that stops the app (the
    test above hit it one run in a few)."""
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await screen.run_action("split")
        await pilot.pause()
        closed = screen.pane()
        area = closed.query_one(ChatInput)
        width, height = area.size
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: closed not in screen.panes and not area.is_attached)
        lines = area.render_lines(Region(0, 0, width, height))
        assert [line.text for line in lines] == [" " * width] * height
        assert app.return_code is None


async def test_a_measure_replaced_before_it_ran_leaves_no_coroutine_behind(env):
    """Each keystroke's context measure replaces the one before (an exclusive worker); one
    replaced before it ran was a coroutine never awaited, a RuntimeWarning when collected
    (CI printed it from the fan-out test). No coroutine exists until its worker runs."""
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.pane()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                pane.measure_context()
            await pilot.pause()
            gc.collect()
        assert not [w for w in caught if "never awaited" in str(w.message)]
        assert app.return_code is None


async def test_after_a_restart_focus_and_every_action_are_the_same_pane(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await screen.run_action("split")
        await pilot.pause()
        first, second = screen.panes
        second.session.max_tokens = 4
        await second.send("the second chat")
        await wait_for(pilot, lambda: not second.busy and len(second.session.messages) == 2)
        first.focus_input()
        await pilot.pause()
        await long_reply(first)  # the first pane, focused, streams as the app goes down
        await wait_for(pilot, lambda: len(first.session.messages) == 2)
        await wait_for(pilot, lambda: len(first.session.messages[-1].content) > 10)
        kept = (first.session.id, second.session.id)
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await wait_for(pilot, lambda: len(screen.panes) == 2)
        await pilot.pause(0.3)
        first, second = screen.panes
        assert (first.session.id, second.session.id) == kept
        assert first.query_one(ChatInput).has_focus
        assert screen.pane() is first and screen.watched_id() == kept[0]
        await pilot.press("x")
        assert first.query_one(ChatInput).text == "x" and second.query_one(ChatInput).text == ""
        exported = screen.pane().export()
        assert f"-{kept[0]}.md" in exported.name
        first.query_one(ChatInput).clear()
        await first.on_prompt_submitted(PromptSubmitted("/continue"))
        await wait_for(pilot, lambda: first.busy)
        await wait_for(pilot, lambda: decoding(app) == 1)
        await press_soon(pilot, "escape")  # stops the focused pane's reply
        await wait_for(pilot, lambda: not first.busy)
        await wait_for(pilot, lambda: app.host.engine.stats().num_running == 0)
        await press_soon(pilot, "f6", "y")  # the next pane, and the key lands there
        await wait_for(pilot, lambda: second.query_one(ChatInput).text == "y")
        assert screen.pane() is second and screen.watched_id() == kept[1]


async def test_a_key_typed_right_after_f6_lands_in_the_next_pane(env):
    """Under load the keys are queued together: F6's focus must be there before the next."""
    from textual import events

    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await screen.run_action("split")
        await pilot.pause()
        first, second = screen.panes
        first.focus_input()
        await pilot.pause()
        for key, char in (("f6", None), ("T", "T"), ("r", "r")):
            app._driver.send_message(events.Key(key, char))  # queued at once, as typed fast
        await wait_for(pilot, lambda: second.query_one(ChatInput).text == "Tr")
        assert first.query_one(ChatInput).text == ""


async def test_continue_after_a_restart_shows_the_reply_whole_as_it_writes(env):
    import sqlite3

    tmp, _ = env
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        pane.session.max_tokens = 40
        await pane.send("write something")
        await wait_for(pilot, lambda: len(pane.session.messages) == 2 and not pane.busy)
        reply = pane.session.messages[-1]
    # as a kill -9 leaves it: the reply still streaming, its process gone
    with sqlite3.connect(tmp / "sessions.db") as db:
        db.execute(
            "UPDATE messages SET status = 'streaming', owner = 'gone-1' WHERE id = ?",
            (reply.id,),
        )
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        view = pane.views[reply.id]
        assert str(view.query_one("Label").render()) == "assistant · interrupted"
        # the reply from its start (the tiny model's text may open with spaces the view keeps)
        head = reply.content.strip()[:20]
        pane.session.max_tokens = 300
        seen = []
        await pane.on_prompt_submitted(PromptSubmitted("/continue"))
        await wait_for(
            pilot, lambda: len(pane.session.messages[-1].content) > len(reply.content) + 20
        )
        while pane.busy:
            seen.append((str(view.query_one("Label").render()), view.markdown.source))
            await pilot.pause(0.05)
        assert seen
        for title, source in seen:
            assert title == "assistant"  # written on: no longer interrupted
            assert source.lstrip().startswith(head)


async def test_a_new_chat_is_in_the_sidebar_during_its_first_reply(env):
    from lucedesk.tui.widgets.session_list import SessionList

    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await long_reply(pane)
        await wait_for(pilot, lambda: len(pane.session.messages) == 2)
        await wait_for(pilot, lambda: len(pane.session.messages[-1].content) > 5)
        await pilot.pause(0.2)
        assert pane.busy
        assert screen.query_one(SessionList).node_of(pane.session.id) is not None
        pane.stop()
        await wait_for(pilot, lambda: not pane.busy)


async def test_the_monitor_shows_running_slots_on_an_80x24_terminal(env):
    from textual.widgets import DataTable

    from lucedesk.tui.widgets.slot_monitor import SlotMonitor

    app = make_app(env)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await screen.run_action("split")
        await pilot.pause()
        for pane in screen.panes:
            await long_reply(pane)
        await press_soon(pilot, "ctrl+g")
        monitor = screen.query_one(SlotMonitor)
        await wait_for(pilot, lambda: decoding(app) == 2)
        monitor.refresh_stats()
        await pilot.pause(0.2)
        table = monitor.query_one(DataTable)
        assert table.row_count == 3  # two running slots, then the idle ones
        assert table.region.height >= 1 + 2  # the header and both running slots show
        for pane in screen.panes:
            pane.stop()
        await wait_for(pilot, lambda: not any(p.busy for p in screen.panes))


async def test_pasted_lines_stay_lines_in_the_transcript(env):
    from lucedesk.tui.widgets.message_view import MessageView

    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        pane.session.max_tokens = 2
        pasted = "def add(a, b):\n    return a + b\nprint(add(1, 2))"
        box = pane.query_one(ChatInput)
        box.focus()
        box.insert(pasted)  # a paste goes into the input as it is
        await pane.on_prompt_submitted(PromptSubmitted(box.text))
        await wait_for(pilot, lambda: len(pane.session.messages) == 2 and not pane.busy)
        view = next(v for v in pane.query(MessageView) if v.role == "user")
        await pilot.pause(0.1)
        assert view.size.height >= 1 + 3  # its title, then each line on its own (Markdown
        # joined them into one paragraph)
        typed = view.query_one(".typed")
        lines = [line.text.strip() for line in typed.render_lines(typed.region.reset_offset)]
        assert [line for line in lines if line] == [
            "def add(a, b):",
            "return a + b",
            "print(add(1, 2))",
        ]


async def test_quitting_while_replies_and_an_http_stream_run_ends_them_cleanly(env):
    """Ctrl+Q stops generation first, so an open HTTP stream ends as a stream ends (the
    server stopped first had waited for it, then cut it: a blank screen for seconds)."""
    import threading

    import httpx

    app = make_app(env, http=True)
    got: list[str] = []
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await screen.run_action("split")
        await pilot.pause()
        for pane in screen.panes:
            await long_reply(pane)
        url = app.host.url

        def stream() -> None:
            body = {"model": "default", "stream": True, "max_tokens": 900, "ignore_eos": True}
            body["messages"] = [{"role": "user", "content": "count on"}]
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    got.append(line)

        client = threading.Thread(target=stream)
        client.start()
        await wait_for(pilot, lambda: decoding(app) == 3)
        engine = app.host.engine
        await press_soon(pilot, "ctrl+q")
    client.join(10)
    assert not client.is_alive()
    assert [line for line in got if line][-1] == "data: [DONE]"  # ended, not cut
    assert not engine.running and engine._thread is None


async def test_f2_and_a_click_leave_the_sidebar_its_keys(env):
    from lucedesk.tui.screens.dialogs import TextDialog
    from lucedesk.tui.widgets.session_list import SessionList

    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await short_reply(pilot, pane, "first chat")
        first = pane.session.id
        await screen.run_action("new_session")
        await short_reply(pilot, pane, "second chat")
        tree = screen.query_one(SessionList)
        await wait_for(pilot, lambda: tree.node_of(first) is not None)
        await pilot.press("ctrl+b")  # hidden; F2 shows it and takes the focus
        assert not tree.display
        await pilot.press("f2")
        assert tree.display and tree.has_focus
        await pilot.press("f6")
        assert pane.query_one(ChatInput).has_focus
        await pilot.click(SessionList, offset=(4, tree.node_of(first).line + 1))
        await wait_for(pilot, lambda: pane.session.id == first)
        assert tree.has_focus  # a click leaves the focus in the sidebar...
        await pilot.press("r")  # ...so its keys work: r renames, it types nothing
        await wait_for(pilot, lambda: isinstance(app.screen, TextDialog))
        assert pane.query_one(ChatInput).text == ""
        await pilot.press("escape")
        keys = "\n".join(str(b.description) for b in screen.BINDINGS if b.key == "f2")
        assert keys == "Sessions"  # listed by F1, which is written from the bindings


def test_export_names_are_clean_slugs():
    from lucedesk.export import slug

    assert slug("Name three planets?") == "name-three-planets"
    assert slug("  Résumé: list the files!!") == "resume-list-the-files"
    assert slug("日本語") == "session" and slug("") == "session"
    assert slug("a" * 100) == "a" * 60


async def test_an_export_is_named_by_its_title(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await short_reply(pilot, pane, "Name three planets?")
        assert pane.export().name == f"name-three-planets-{pane.session.id}.md"


async def test_a_fanout_split_shows_its_progress_then_the_split_never_its_json(env, monkeypatch):
    from lucedesk.agent import children as agent_children
    from lucedesk.tui.screens.dialogs import SplitDialog
    from lucedesk.tui.widgets.message_view import MessageView

    monkeypatch.setattr(agent_children, "SUBTASK_TITLE_CHARS", 8)
    monkeypatch.setattr(agent_children, "SUBTASK_CHARS", 24)
    shown: list[str] = []
    append, replace = MessageView.append, MessageView.replace

    async def appended(self, text):
        shown.append(self.content + text)
        return await append(self, text)

    async def replaced(self, text):
        shown.append(text)
        return await replace(self, text)

    monkeypatch.setattr(MessageView, "append", appended)
    monkeypatch.setattr(MessageView, "replace", replaced)
    app = make_app(env, slots=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        pane.session.max_tokens = 40
        await pane.on_prompt_submitted(PromptSubmitted("/fanout 2 list some ideas"))
        await wait_for(pilot, lambda: isinstance(app.screen, SplitDialog), 60)
        assert any(t.startswith("Splitting the task into 2 subtasks… ") for t in shown)
        assert not any('"subtasks"' in t or '"title"' in t for t in shown)  # no raw JSON
        await press_soon(pilot, "n")  # declined: nothing runs
        await wait_for(pilot, lambda: not pane.busy)


async def test_commands_for_the_next_turn_run_while_a_reply_streams_and_a_refused_one_is_replaced(
    env,
):
    from textual import events

    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        box = pane.query_one(ChatInput)
        await long_reply(pane)
        await wait_for(pilot, lambda: decoding(app) == 1)
        box.text = "/max 200"
        await pane.on_prompt_submitted(PromptSubmitted(box.text))
        assert pane.session.max_tokens == 200 and box.text == ""  # applied, for the next
        assert pane.busy  # the reply goes on
        box.text = "/tool-choice foo"  # no such tool: refused, left to fix
        await pane.on_prompt_submitted(PromptSubmitted(box.text))
        assert "no tool 'foo'" in " ".join(n for n, _ in app.notices)
        box.focus()
        await pilot.pause()
        for char in "Trains.":
            app._driver.send_message(events.Key(char, char))
        await wait_for(pilot, lambda: box.text == "Trains.")  # typed over it, never joined
        box.text = "/tool-choice none"  # for the next message, not the running one
        await pane.on_prompt_submitted(PromptSubmitted(box.text))
        assert pane.next_choices is not None and pane.agent.tool_choices[0].mode == "auto"
        pane.stop()
        await wait_for(pilot, lambda: not pane.busy)
        pane.session.max_tokens = 2
        await pane.send("next")
        assert pane.agent.tool_choices[0].mode == "none" and pane.next_choices is None
        await wait_for(pilot, lambda: not pane.busy)
