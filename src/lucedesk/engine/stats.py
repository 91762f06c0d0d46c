"""What the engine publishes each step: an immutable snapshot for monitors, plus counters and
latency histograms for /metrics."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lucedesk.engine.request import Request

if TYPE_CHECKING:
    from lucedesk.engine.scheduler import Scheduler

# Latency buckets in seconds (Prometheus-style upper bounds).
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

RATE_WINDOW_S = 2.0

# (when a step began, when it ended, the tokens it produced): what rates are computed from
Span = tuple[float, float, int]


def window_rate(spans: tuple[Span, ...], now: float, window: float = RATE_WINDOW_S) -> float:
    """Tokens per second over the `window` seconds before `now`. Each step's tokens are
    spread over the time the step took, and counted for the part of it inside the window;
    the time counted runs from the first of those steps' start (or the window's) to `now`,
    idle time included. So a rate falls to 0 when steps stop, one slow step is its tokens
    over its own duration, and a request alone has the engine's rate."""
    since = now - window
    tokens = 0.0
    first = now
    for start, end, n in spans:
        if end <= since or start >= now:
            continue
        a, b = max(start, since), min(end, now)
        tokens += n * (b - a) / (end - start) if end > start else n
        first = min(first, a)
    return tokens / (now - first) if now > first else 0.0


def keep_window(spans: deque[Span], now: float, window: float = RATE_WINDOW_S) -> None:
    while spans and spans[0][1] <= now - window:
        spans.popleft()


@dataclass(slots=True, frozen=True)
class SlotStats:
    slot: int
    request_id: str | None = None
    owner: str = ""
    interactive: bool = False  # someone watches it: it decodes every step
    phase: str = "idle"  # idle | prefill | decode
    prompt_tokens: int = 0
    computed_tokens: int = 0  # positions whose KV is cached
    output_tokens: int = 0
    context_tokens: int = 0  # prompt + output
    blocks: int = 0
    ttft_s: float | None = None
    preemptions: int = 0
    draft_tokens: int = 0  # prompt-lookup draft tokens verified for this request
    accepted_tokens: int = 0  # ...and kept
    spans: tuple[Span, ...] = ()  # this request's steps of the last RATE_WINDOW_S
    # When a step last ran a row of it (a token, or a chunk of its prompt), or when it was
    # submitted if none has yet (monotonic).
    progress_time: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """Its output rate now: read later than the snapshot was taken, lower."""
        return window_rate(self.spans, time.monotonic())

    @property
    def wait_s(self) -> float | None:
        """Seconds since it last advanced, as of now (None for an idle slot)."""
        if self.progress_time is None:
            return None
        return max(0.0, time.monotonic() - self.progress_time)


@dataclass(slots=True, frozen=True)
class HistogramSnapshot:
    buckets: tuple[float, ...]
    counts: tuple[int, ...]  # cumulative count per bucket, as Prometheus wants
    total: float
    count: int


@dataclass(slots=True, frozen=True)
class EngineStats:
    time: float = 0.0
    step: int = 0
    model: str = ""
    slots: tuple[SlotStats, ...] = ()
    num_running: int = 0
    num_waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    # Blocks ever handed out: the pool is reserved, not written, so these are its resident
    # part (kv_cache.BlockPool); kv_block_bytes each, every layer's K and V.
    blocks_touched: int = 0
    kv_block_bytes: int = 0
    block_size: int = 16
    num_preemptions: int = 0
    num_completed: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    ttft: HistogramSnapshot | None = None
    itl: HistogramSnapshot | None = None
    prefix_cache_hit_tokens: int = 0
    prefix_disk_hit_tokens: int = 0  # ...of which were read from the cache on disk
    pool_basis: str = ""  # why the KV pool holds blocks_total blocks (catalog.fit.pool_basis)
    prefix_cache_queries: int = 0
    prefix_cached_blocks: int = 0
    # Prompt-lookup speculation: decode rows that carried a draft, their draft tokens, and
    # the tokens kept; each such row gave 1 + kept tokens.
    draft_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spans: tuple[Span, ...] = ()  # the engine's steps of the last RATE_WINDOW_S

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S, as of now (an engine
        with nothing to do publishes no snapshots; its rate still falls to 0)."""
        return window_rate(self.spans, time.monotonic())

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_draft_row(self) -> float:
        return 1 + self.accepted_tokens / self.draft_rows if self.draft_rows else 0.0


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return HistogramSnapshot(self.buckets, tuple(cumulative), self.total, self.count)


class StatsCollector:
    """Owned by the engine thread: fed once per produced token and once per step."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.finish_reasons: Counter[str] = Counter()
        self.num_completed = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._spans: deque[Span] = deque()  # the engine's steps
        self._request_spans: dict[str, deque[Span]] = {}
        self._step_tokens: Counter[str] = Counter()  # by request, in the step under way
        # Idle slots' stats, made once (they are immutable): a snapshot follows every step,
        # and making fifteen idle ones anew each time was a quarter of its cost
        self._idle: dict[int, SlotStats] = {}

    def on_token(self, req: Request, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            self.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        self._step_tokens[req.request_id] += 1
        self.generation_tokens_total += 1

    def on_finish(self, req: Request) -> None:
        self.num_completed += 1
        self.finish_reasons[req.finish_reason.value] += 1
        self.prompt_tokens_total += req.num_prompt_tokens
        self._request_spans.pop(req.request_id, None)
        self._step_tokens.pop(req.request_id, None)

    def on_step(self, started: float, now: float, num_generated: int) -> None:
        """A step that began at `started` ended at `now` having produced `num_generated`
        tokens (those of each request were counted by on_token)."""
        if num_generated:
            self._spans.append((started, now, num_generated))
        keep_window(self._spans, now)
        for rid, n in self._step_tokens.items():
            self._request_spans.setdefault(rid, deque()).append((started, now, n))
        self._step_tokens.clear()
        for spans in self._request_spans.values():
            keep_window(spans, now)

    def spans(self) -> tuple[Span, ...]:
        return tuple(self._spans)

    def slot(self, slot: int, req: Request | None, now: float) -> SlotStats:
        if req is None:
            return self._idle.get(slot) or self._idle.setdefault(slot, SlotStats(slot))
        return SlotStats(
            slot=slot,
            request_id=req.request_id,
            owner=req.owner,
            interactive=req.interactive,
            phase=req.phase.value,
            prompt_tokens=req.num_prompt_tokens,
            computed_tokens=req.num_computed_tokens,
            output_tokens=req.num_output_tokens,
            context_tokens=req.num_tokens,
            blocks=len(req.block_ids),
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
            preemptions=req.num_preemptions,
            draft_tokens=req.num_draft_tokens,
            accepted_tokens=req.num_accepted_tokens,
            spans=tuple(self._request_spans.get(req.request_id, ())),
            progress_time=req.progress_time or req.arrival_time,
        )

    def snapshot(
        self,
        sched: Scheduler,
        model: str,
        now: float,
        num_pending: int = 0,
        pool_basis: str = "",
        kv_block_bytes: int = 0,
    ) -> EngineStats:
        """What monitors see after a step: the scheduler's slots, queue, pool and counters
        with these rates and latencies; `num_pending` requests are submitted and not yet
        seen by the engine thread (they count as waiting)."""
        by_slot = {r.slot: r for r in sched.running}
        pool = sched.pool
        return EngineStats(
            time=now,
            step=sched.step,
            model=model,
            slots=tuple(self.slot(i, by_slot.get(i), now) for i in range(sched.config.max_slots)),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + num_pending,
            blocks_used=pool.num_used_blocks,
            blocks_total=pool.num_blocks,
            blocks_touched=pool.num_touched_blocks,
            kv_block_bytes=kv_block_bytes,
            block_size=pool.block_size,
            pool_basis=pool_basis,
            spans=self.spans(),
            num_preemptions=sched.num_preemptions,
            num_completed=self.num_completed,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            finish_reasons=dict(self.finish_reasons),
            ttft=self.ttft.snapshot(),
            itl=self.itl.snapshot(),
            prefix_cache_hit_tokens=sched.num_prefix_hit_tokens,
            prefix_disk_hit_tokens=sched.num_disk_hit_tokens,
            prefix_cache_queries=sched.num_prefix_query_tokens,
            prefix_cached_blocks=pool.num_cached_blocks,
            draft_rows=sched.num_draft_rows,
            draft_tokens=sched.num_draft_tokens,
            accepted_tokens=sched.num_accepted_tokens,
        )
