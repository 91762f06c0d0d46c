"""Snapshots of the TUI at a fixed terminal size: the main screen, the split view and the
monitor, with nothing generating (so every frame is reproducible)."""

from __future__ import annotations

import pytest

from tests.test_tui import make_app, prepare, started

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
    await pilot.pause(0.6)  # at least two monitor refreshes
    await steady(pilot)


def test_main_screen(snap_compare, app):
    assert snap_compare(app, terminal_size=SIZE, run_before=_main)


def test_split_view(snap_compare, app):
    assert snap_compare(app, terminal_size=SIZE, run_before=_split)


def test_slot_monitor(snap_compare, app):
    assert snap_compare(app, terminal_size=SIZE, run_before=_monitor)
