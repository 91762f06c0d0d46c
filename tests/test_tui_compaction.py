"""Sessions that never dead-end, in the TUI on a model with a 1,024-token context: a long
chat compacted and answered every time (marked on screen, the store whole), the context use
in the header, a 2,000-line paste folded, refused with its count and left to edit, and a
message typed while the pane answers queued, taken back with Esc, and sent when the reply
ends."""

from __future__ import annotations

import random

import pytest
from textual import events

from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.compaction_view import CompactionView
from lucedesk.tui.widgets.pane_input import short
from tests.test_tui import SIZE, make_app, prepare, started, type_and_send, wait_for
from tests.test_tui_real_use import press_soon

WORDS = "river stone lamp orange quiet garden metal cloud paper window seven bright".split()


@pytest.fixture
def env(tmp_path, monkeypatch, tiny_llama):
    return prepare(tmp_path, monkeypatch, tiny_llama)


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def test_twelve_long_messages_on_a_small_context_are_all_answered(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "/max 16")
        rng = random.Random(11)
        for i in range(12):
            text = f"message {i}: " + prose(rng, 54)
            assert 200 <= pane.count_text(text) <= 300
            await type_and_send(pilot, pane, text)
            await wait_for(pilot, lambda: not pane.busy and pane.session.messages[-1].content)
            assert pane.session.messages[-1].role == "assistant"
            assert not pane.session.messages[-1].error
        stored = app.store.session(pane.session.id).messages
        spoken = [m for m in stored if m.role != "compaction"]
        assert [m.role for m in spoken] == ["user", "assistant"] * 12  # the store keeps all
        markers = [m for m in stored if m.role == "compaction"]
        assert markers
        shown = list(pane.log_view.query(CompactionView))
        assert len(shown) == len(markers)
        assert shown[-1].title.startswith(f"compacted: {markers[-1].compacted} messages")
        await wait_for(pilot, lambda: pane.context is not None)
        used, limit = pane.context
        # The prompt stays under compact_at (0.8); the reply (/max 16) comes on top of it.
        assert limit == 1024 and 0 < used <= 0.8 * 1024 + 16
        assert f"ctx {short(used)}/1.0k · " in pane.header_text()


async def test_a_2000_line_paste_is_folded_refused_with_its_count_and_left_to_edit(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        box = pane.query_one(ChatInput)
        box.focus()
        paste = "\n".join(f"{i}: " + prose(random.Random(i), 8) for i in range(2000))
        box.post_message(events.Paste(paste.replace("\n", "\r")))  # as terminals send it
        await pilot.pause()
        tokens = pane.count_text(paste)
        assert box.text == f"[pasted 2,000 lines · {tokens:,} tokens]"
        assert box.whole_text == paste
        await wait_for(pilot, lambda: "too long" in pane.header_text())
        await pilot.press("enter")
        await pilot.pause()
        refused = [text for text, severity in app.notices if severity == "error"]
        assert refused and f"the message is {tokens:,} tokens" in refused[-1]
        assert box.whole_text == paste and pane.session.messages == []  # nothing lost or stored
        await pilot.press("ctrl+o")  # unfolded to edit
        assert box.text == paste and not box.pastes
        box.clear()
        await type_and_send(pilot, pane, "/max 4")
        await type_and_send(pilot, pane, "a short question")
        await wait_for(pilot, lambda: len(pane.session.messages) == 2 and not pane.busy)
        assert pane.session.messages[-1].content


async def test_a_message_typed_while_the_pane_answers_is_queued_then_sent(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        box = pane.query_one(ChatInput)
        await type_and_send(pilot, pane, "/max 600")
        await type_and_send(pilot, pane, "a long answer please")
        await wait_for(pilot, lambda: pane.busy)
        box.text = "and then this"
        await press_soon(pilot, "enter")
        queued = pane.query_one("#queued")
        await wait_for(pilot, lambda: queued.has_class("shown"))
        assert "and then this" in str(queued.render()) and box.text == ""
        await press_soon(pilot, "escape")  # taken back to edit; the reply goes on
        await wait_for(pilot, lambda: box.text == "and then this")
        assert pane.busy and not pane.queued and not queued.has_class("shown")
        box.text = "and then this, edited"
        await press_soon(pilot, "enter")
        await wait_for(pilot, lambda: pane.queued == ["and then this, edited"])
        assert [m.role for m in pane.session.messages] == ["user", "assistant"]
        pane.session.max_tokens = 8  # for the next reply (the running one keeps its 600)
        spoken = lambda: [m for m in pane.session.messages if m.role != "compaction"]  # noqa: E731
        await wait_for(pilot, lambda: len(spoken()) == 4, timeout=120)
        await wait_for(pilot, lambda: not pane.busy)
        user, reply = spoken()[2:]
        assert user.content == "and then this, edited" and reply.content
        assert not queued.has_class("shown")
