"""What the engine publishes each step: an immutable snapshot for monitors, plus counters and
latency histograms for /metrics."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from lucedesk.engine.request import Request

# Latency buckets in seconds (Prometheus-style upper bounds).
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

RATE_WINDOW_S = 2.0


@dataclass(slots=True, frozen=True)
class SlotStats:
    slot: int
    request_id: str | None = None
    owner: str = ""
    phase: str = "idle"  # idle | prefill | decode
    prompt_tokens: int = 0
    computed_tokens: int = 0  # positions whose KV is cached
    output_tokens: int = 0
    context_tokens: int = 0  # prompt + output
    blocks: int = 0
    tokens_per_s: float = 0.0
    ttft_s: float | None = None
    preemptions: int = 0
    draft_tokens: int = 0  # prompt-lookup draft tokens verified for this request
    accepted_tokens: int = 0  # ...and kept


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
    block_size: int = 16
    tokens_per_s: float = 0.0  # generated tokens per second over the last couple of seconds
    num_preemptions: int = 0
    num_completed: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    ttft: HistogramSnapshot | None = None
    itl: HistogramSnapshot | None = None
    prefix_cache_hit_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cached_blocks: int = 0
    # Prompt-lookup speculation: decode rows that carried a draft, their draft tokens, and
    # the tokens kept; each such row gave 1 + kept tokens.
    draft_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

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
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) per step
        self._token_times: dict[str, deque[float]] = {}

    def on_token(self, req: Request, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            self.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        times = self._token_times.setdefault(req.request_id, deque(maxlen=32))
        times.append(now)
        self.generation_tokens_total += 1

    def on_finish(self, req: Request) -> None:
        self.num_completed += 1
        self.finish_reasons[req.finish_reason.value] += 1
        self.prompt_tokens_total += req.num_prompt_tokens
        self._token_times.pop(req.request_id, None)

    def on_step(self, now: float, num_generated: int) -> None:
        self._recent.append((now, num_generated))
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def rate(self, now: float) -> float:
        if not self._recent:
            return 0.0
        span = max(now - self._recent[0][0], 1e-3)
        if now - self._recent[-1][0] > RATE_WINDOW_S:
            return 0.0
        return sum(n for _, n in self._recent) / max(span, 0.25)

    def slot_rate(self, request_id: str, now: float) -> float:
        times = [t for t in self._token_times.get(request_id, ()) if now - t <= RATE_WINDOW_S]
        if len(times) < 2 or times[-1] == times[0]:
            return 0.0
        return (len(times) - 1) / (times[-1] - times[0])

    def slot(self, slot: int, req: Request | None, now: float) -> SlotStats:
        if req is None:
            return SlotStats(slot)
        return SlotStats(
            slot=slot,
            request_id=req.request_id,
            owner=req.owner,
            phase=req.phase.value,
            prompt_tokens=req.num_prompt_tokens,
            computed_tokens=req.num_computed_tokens,
            output_tokens=req.num_output_tokens,
            context_tokens=req.num_tokens,
            blocks=len(req.block_ids),
            tokens_per_s=self.slot_rate(req.request_id, now),
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
            preemptions=req.num_preemptions,
            draft_tokens=req.num_draft_tokens,
            accepted_tokens=req.num_accepted_tokens,
        )
