"""The one-line engine status under the panes: slots in use, queue, KV pool, throughput.
Refreshed on a timer (2 Hz) from the engine's stats snapshot, never per token."""

from __future__ import annotations

from collections.abc import Callable

from textual.widgets import Label

from lucedesk.engine import EngineStats

REFRESH_S = 0.5


def status_text(stats: EngineStats | None) -> str:
    if stats is None:
        return "engine · not running"
    parts = [
        "engine",
        f"{stats.num_running} running",
        f"{stats.num_waiting} waiting",
        f"KV {stats.blocks_used}/{stats.blocks_total} blocks",
        f"{stats.tokens_per_s:.1f} tok/s",
    ]
    if stats.num_preemptions:
        parts.append(f"preemptions {stats.num_preemptions}")
    return " · ".join(parts)


class EngineStatus(Label):
    DEFAULT_CSS = """
    EngineStatus { height: 1; width: 1fr; padding: 0 1; color: $text-muted; }
    """

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        super().__init__("")
        self._stats = stats
        self.shown = ""  # what the label shows now

    def on_mount(self) -> None:
        self.refresh_stats()
        self.set_interval(REFRESH_S, self.refresh_stats)

    def refresh_stats(self) -> None:
        text = status_text(self._stats())
        if text != self.shown:  # an idle engine costs the UI nothing
            self.shown = text
            self.update(text, layout=False)  # one line of fixed size: no layout pass
