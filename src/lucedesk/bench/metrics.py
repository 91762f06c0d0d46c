"""Per-request timing records and the summary statistics every benchmark reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    start: float  # when the request was sent
    token_times: list[float] = field(default_factory=list)  # arrival of each output token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    expected_output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def end(self) -> float:
        return self.token_times[-1] if self.token_times else self.start


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(slots=True)
class Summary:
    num_requests: int
    num_failed: int
    duration_s: float
    output_tokens: int
    prompt_tokens: int
    output_tok_s: float
    requests_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    itl_p50: float
    itl_p90: float
    itl_p99: float
    max_itl: float
    goodput_requests_s: float | None = None
    length_mismatches: int = 0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> Summary:
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [x for r in ok for x in r.itls]
    out_tokens = sum(r.num_output_tokens for r in ok)
    goodput = None
    if slo_ttft is not None or slo_tpot is not None:
        good = [
            r
            for r in ok
            if (slo_ttft is None or (r.ttft is not None and r.ttft <= slo_ttft))
            and (slo_tpot is None or r.tpot is None or r.tpot <= slo_tpot)
        ]
        goodput = len(good) / duration_s if duration_s > 0 else 0.0
    return Summary(
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        output_tokens=out_tokens,
        prompt_tokens=sum(r.num_prompt_tokens for r in ok),
        output_tok_s=out_tokens / duration_s if duration_s > 0 else 0.0,
        requests_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p90=percentile(tpots, 90),
        tpot_p99=percentile(tpots, 99),
        itl_p50=percentile(itls, 50),
        itl_p90=percentile(itls, 90),
        itl_p99=percentile(itls, 99),
        max_itl=max(itls) if itls else math.nan,
        goodput_requests_s=goodput,
        length_mismatches=sum(
            1
            for r in ok
            if r.expected_output_tokens and r.num_output_tokens != r.expected_output_tokens
        ),
    )
