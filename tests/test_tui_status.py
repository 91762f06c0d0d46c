"""The engine status line, the folded slot monitor, and keys typed while the model loads."""

from __future__ import annotations

import threading

import pytest
from textual.widgets import DataTable, Input, Label

from lucedesk.engine.request import Request, SamplingParams
from lucedesk.engine.stats import RATE_WINDOW_S, SlotStats, StatsCollector, window_rate
from lucedesk.tui.engine_host import EngineHost
from lucedesk.tui.screens.loading import LoadingScreen
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.engine_status import EngineStatus
from lucedesk.tui.widgets.slot_monitor import SlotMonitor, slot_ranges, slot_rows, wait_text
from tests.test_tui import (
    SIZE,
    ask_for_a_long_reply,
    make_app,
    prepare,
    replied,
    started,
    wait_for,
)


@pytest.fixture
def env(tmp_path, monkeypatch, tiny_llama):
    return prepare(tmp_path, monkeypatch, tiny_llama)


def test_slot_ranges_fold_runs():
    assert slot_ranges([0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]) == "0, 4-15"
    assert slot_ranges([3]) == "3"
    assert slot_ranges([0, 1, 3, 5, 6]) == "0-1, 3, 5-6"


def test_wait_reads_in_seconds_then_minutes():
    assert wait_text(None) == ""
    assert wait_text(0.04) == "0.0 s"
    assert wait_text(3.14) == "3.1 s"
    assert wait_text(125.0) == "2 m 05 s"


def test_sixteen_slots_two_busy_show_three_rows():
    busy = {1: "pane:a", 2: "http:b"}
    slots = tuple(
        SlotStats(n, request_id=f"r{n}", owner=busy[n], phase="decode")
        if n in busy
        else SlotStats(n)
        for n in range(16)
    )
    rows = slot_rows(slots)
    assert [r[:3] for r in rows] == [
        ("1", "pane:a", "decode"),
        ("2", "http:b", "decode"),
        ("0, 3-15", "", "14 idle"),
    ]


def test_rates_are_over_a_real_time_window_and_fall_to_zero():
    """Known steps at known times: steady decode, one slow step, idle, one request alone."""
    c = StatsCollector()
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000))
    t = 100.0
    for _ in range(100):  # 10 ms steps of one token each for 1 s
        c.on_token(req, t + 0.01)
        c.on_step(t, t + 0.01, 1)
        t += 0.01
    assert window_rate(c.spans(), t) == pytest.approx(100.0)
    mine = c.slot(0, req, t)
    assert window_rate(mine.spans, t) == pytest.approx(100.0)  # alone: the engine's rate
    # idle: the same tokens over a longer time, then nothing in the window at all
    assert window_rate(c.spans(), t + 1.0) == pytest.approx(50.0)
    assert window_rate(c.spans(), t + RATE_WINDOW_S + 0.01) == 0.0
    assert window_rate(mine.spans, t + RATE_WINDOW_S + 0.01) == 0.0
    # after the idle time, one slow step (0.25 s for one token) is 4 tok/s, not 4x that
    t += 10.0
    c.on_token(req, t + 0.25)
    c.on_step(t, t + 0.25, 1)
    assert window_rate(c.spans(), t + 0.25) == pytest.approx(4.0)
    assert window_rate(c.slot(0, req, t + 0.25).spans, t + 0.25) == pytest.approx(4.0)
    # a step that produced nothing (prefill) counts as time, not tokens
    c.on_step(t + 0.25, t + 0.5, 0)
    assert window_rate(c.spans(), t + 0.5) == pytest.approx(2.0)
    # a snapshot read later than it was taken shows the rate as of the read
    assert SlotStats(0, spans=((0.0, 0.01, 1),)).tokens_per_s == 0.0


async def test_status_line_shows_slots_in_use_while_a_reply_runs(env):
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        status = screen.query_one(EngineStatus)
        await wait_for(pilot, lambda: status.shown.startswith("engine · 0 running · 0 waiting"))
        assert "KV 0/" in status.shown and "preemptions" not in status.shown
        assert status.region.height == 1 and status.region.y == SIZE[1] - 2  # above the footer
        pane = screen.panes[0]
        await ask_for_a_long_reply(pilot, pane)
        await wait_for(pilot, lambda: "1 running" in status.shown)
        assert str(status.render()) == status.shown
        await pilot.press("escape")
        await wait_for(pilot, lambda: replied(pane, 2))
        await wait_for(pilot, lambda: status.shown.startswith("engine · 0 running"))


async def test_monitor_folds_idle_slots_into_one_row(env):
    app = make_app(env, slots=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await pilot.press("ctrl+g")
        monitor = screen.query_one(SlotMonitor)
        table = monitor.query_one(DataTable)
        monitor.refresh_stats()
        assert [table.get_row_at(i)[:3] for i in range(table.row_count)] == [["0-3", "", "4 idle"]]
        await ask_for_a_long_reply(pilot, pane)
        await wait_for(pilot, lambda: app.host.engine.stats().num_running == 1)
        monitor.refresh_stats()
        rows = [table.get_row_at(i) for i in range(table.row_count)]
        assert len(rows) == 2
        assert rows[0][1] == f"» {pane.agent.owner}"  # the focused pane's: watched
        assert rows[1][1:3] == ["", "3 idle"]
        pane.stop()
        await wait_for(pilot, lambda: not pane.busy)


async def test_keys_typed_while_loading_land_in_the_first_input(env, monkeypatch):
    # The engine starts only once the test has typed: the loading screen is up all along.
    typed = threading.Event()
    start = EngineHost.start

    def gated_start(self, progress):
        typed.wait(30)
        start(self, progress)

    monkeypatch.setattr(EngineHost, "start", gated_start)
    app = make_app(env)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen))
        loading = app.screen
        early = loading.query_one("#early", Input)
        await wait_for(pilot, lambda: app.focused is early)
        await pilot.press(*"hello", "space", *"there", "enter")
        assert isinstance(app.screen, LoadingScreen)
        assert early.value == "hello there"  # Enter kept it
        status = str(loading.query_one("#status", Label).render())
        assert "will be in the input when the model is ready" in status
        typed.set()
        screen = await started(pilot)
        pane = screen.panes[0]
        box = pane.query_one(ChatInput)
        assert box.text == "hello there"
        assert app.focused is box
        assert pane.session.messages == []  # kept, not sent
        assert app.pending_input == ""
        # start-up showed its stages, each done with its time
        stages = [line for line, _ in loading.stages]
        assert stages[0].startswith("profile cpu") and stages[1].startswith("loading llama")
        assert stages[-1].startswith("warming up")
        shown = loading.stage_text()
        assert "✓ profile cpu" in shown and "✓ loading" in shown and "… warming up" in shown
