"""The TUI under a daily user's hands, on the pilot: panes closed while they stream, a restart
that keeps each pane's session and focus together, a new chat in the sidebar from its first
reply, small screens, pasted lines, keys right after F6, a quick quit, and the other
rough edges found by hand."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.test_tui import (
    SIZE,
    make_app,
    prepare,
    started,
    type_and_send,
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
