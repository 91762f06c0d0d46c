"""The slot monitor: one row per busy slot and one for all idle slots, the KV pool,
throughput, queue and preemptions. Refreshed on a timer (1 Hz) from the engine's stats
snapshot, never per token."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Label, ProgressBar, Sparkline

from lucedesk.engine import EngineStats, SlotStats
from lucedesk.tui.remote import remote_slots

REFRESH_S = 1.0  # each redraw takes the engine's cores from it: once a second is enough
REMOTE_REFRESH_S = 1.0
LEGEND = (
    "context: the tokens a slot holds (system prompt, tool descriptions, the conversation, "
    "its reply so far) · » watched: decodes every step · blocks: its share of the KV pool · "
    "tok/s: over the last 2 s · wait: since a step last ran it (a token or a prompt chunk)"
)


def phase_text(slot: SlotStats) -> str:
    """A busy slot's phase; idle slots share one row (see slot_rows)."""
    if slot.phase == "prefill":
        return f"prefill {slot.computed_tokens}/{slot.context_tokens}"
    return slot.phase


def wait_text(seconds: float | None) -> str:
    """How long a slot has waited for a step, to a tenth of a second below a minute."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds // 60:.0f} m {seconds % 60:02.0f} s"


def slot_ranges(slots: list[int]) -> str:
    """Sorted slot numbers as ranges: [0, 4, 5, 6] -> "0, 4-6"."""
    runs: list[list[int]] = []
    for n in slots:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def slot_rows(slots: tuple[SlotStats, ...]) -> list[tuple[str, ...]]:
    """One row per busy slot, then one row for all the idle ones (a 16-slot engine with two
    replies running shows three rows)."""
    rows = []
    idle = []
    for slot in slots:
        if slot.request_id is None:
            idle.append(slot.slot)
            continue
        rows.append(
            (
                str(slot.slot),
                ("» " if slot.interactive else "") + slot.owner,
                phase_text(slot),
                str(slot.context_tokens),
                str(slot.blocks),
                f"{slot.tokens_per_s:.1f}",
                wait_text(slot.wait_s),
                f"{slot.ttft_s * 1000:.0f} ms" if slot.ttft_s is not None else "",
            )
        )
    if idle:
        rows.append((slot_ranges(sorted(idle)), "", f"{len(idle)} idle", "", "", "", "", ""))
    return rows


class SlotMonitor(Vertical):
    DEFAULT_CSS = """
    SlotMonitor { height: 45%; border: round $secondary; display: none; }
    SlotMonitor.visible { display: block; }
    SlotMonitor > DataTable { height: 1fr; }
    SlotMonitor #pool { height: 1; }
    SlotMonitor #pool ProgressBar { width: 40; }
    SlotMonitor Sparkline { width: 1fr; height: 2; margin: 0 1; }
    SlotMonitor Label { padding: 0 1; }
    SlotMonitor #kv-text { width: 1fr; }
    SlotMonitor #summary, SlotMonitor #legend { width: 1fr; height: 1; text-wrap: nowrap;
                                                text-overflow: ellipsis; }
    SlotMonitor #legend { color: $text-muted; }
    SlotMonitor #remote.empty { display: none; }
    /* A short terminal (80x24): the slot rows first; the rate's graph and the legend go */
    SlotMonitor.compact Sparkline, SlotMonitor.compact #legend { display: none; }
    """
    COMPACT_BELOW = 32  # terminal rows

    def __init__(
        self, stats: Callable[[], EngineStats | None], remote_url: Callable[[], str]
    ) -> None:
        super().__init__()
        self.border_title = "slots"
        self._stats = stats
        self._remote_url = remote_url
        self._rates: deque[float] = deque([0.0] * 60, maxlen=60)
        self._rows: list[tuple[str, ...]] = []

    def compose(self) -> ComposeResult:
        table = DataTable(zebra_stripes=True, cursor_type="none")
        table.add_columns("slot", "owner", "phase", "context", "blocks", "tok/s", "wait", "TTFT")
        yield table
        with Horizontal(id="pool"):
            yield Label("KV", id="kv-label")
            yield ProgressBar(total=1, show_eta=False, show_percentage=True, id="kv")
            yield Label("", id="kv-text")
        yield Sparkline(list(self._rates), summary_function=max)
        yield Label("", id="summary")
        yield Label(LEGEND, id="legend")
        yield Label("", id="remote", classes="empty")

    def on_mount(self) -> None:
        self.fit(self.app.size.height)
        self.set_interval(REFRESH_S, self.refresh_stats)
        self.set_interval(REMOTE_REFRESH_S, self.refresh_remote)

    def fit(self, rows: int) -> None:
        """The compact form on a short terminal: every running slot's row still shows."""
        self.set_class(rows < self.COMPACT_BELOW, "compact")

    async def refresh_remote(self) -> None:
        """For a pane that talks to another server: what that server's /slots reports."""
        url = self._remote_url() if self.has_class("visible") else ""
        text = f"remote {await remote_slots(url)}" if url else ""
        label = self.query_one("#remote", Label)
        label.update(text)
        label.set_class(not text, "empty")

    def refresh_stats(self) -> None:
        stats = self._stats()
        if stats is None or not self.has_class("visible"):
            return
        rows = slot_rows(stats.slots)
        if rows != self._rows:  # an idle engine costs the UI nothing
            table = self.query_one(DataTable)
            same_slots = len(rows) == len(self._rows) and all(
                new[0] == old[0] for new, old in zip(rows, self._rows)
            )
            if same_slots:  # the usual tick: a few cells changed (tok/s, context, phase)
                for r, (new, old) in enumerate(zip(rows, self._rows)):
                    for c, (value, was) in enumerate(zip(new, old)):
                        if value != was:
                            table.update_cell_at(Coordinate(r, c), value)
            else:  # a slot started or ended: the rows themselves change
                table.clear()
                table.add_rows(rows)
            self._rows = rows
        self.query_one("#kv", ProgressBar).update(
            total=max(stats.blocks_total, 1), progress=stats.blocks_used
        )
        # Fixed-size labels: updated without a layout pass of the whole screen.
        kv = f"{stats.blocks_used}/{stats.blocks_total} blocks of {stats.block_size} tokens"
        # On the bottom border: why the pool is that size, and how much of it is resident
        # (its pages are, once a block has been used)
        about = [stats.pool_basis] if stats.pool_basis else []
        if stats.kv_block_bytes:
            about.append(f"{stats.blocks_touched * stats.kv_block_bytes / 2**20:,.0f} MiB resident")
        basis = "KV pool: " + " · ".join(about) if about else ""
        if self.border_subtitle != basis:
            self.border_subtitle = basis
        self.query_one("#kv-text", Label).update(kv, layout=False)
        self._rates.append(stats.tokens_per_s)
        if any(self._rates) or self.query_one(Sparkline).data != list(self._rates):
            self.query_one(Sparkline).data = list(self._rates)
        disk = stats.prefix_disk_hit_tokens
        hits = (
            f" · prefix-cache hits {stats.prefix_cache_hit_tokens} tok"
            + (f" ({disk} from disk)" if disk else "")
            if stats.prefix_cache_queries
            else ""
        )
        drafts = (
            f" · drafts {stats.acceptance_rate:.0%} kept, {stats.tokens_per_draft_row:.1f} tok/step"
            if stats.draft_rows
            else ""
        )
        summary = (
            f"{stats.tokens_per_s:.1f} tok/s · running {stats.num_running} · "
            f"queued {stats.num_waiting} · preemptions {stats.num_preemptions}{hits}{drafts}"
        )
        self.query_one("#summary", Label).update(summary, layout=False)
