"""`lucedesk bench --offline`: closed-loop load on the in-process engine, no HTTP."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from lucedesk.bench.metrics import RequestRecord, Summary, summarize
from lucedesk.engine import Engine, SamplingParams


def random_prompts(
    engine: Engine, num: int, length: int | tuple[int, int], seed: int
) -> list[list[int]]:
    """Distinct random token sequences (no shared prefixes), avoiding special tokens; each
    `length` long, or drawn from the (MIN, MAX) range."""
    rng = random.Random(seed)
    lo, hi = (length, length) if isinstance(length, int) else length
    vocab = engine.tokenizer.vocab_size
    specials = engine.tokenizer.special_ids
    pool = [t for t in range(vocab) if t not in specials]
    return [[rng.choice(pool) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def closed_loop(
    engine: Engine,
    prompts: list[list[int]],
    output_len: int | list[int],
    concurrency: int,
    params: SamplingParams | None = None,
) -> tuple[list[RequestRecord], float]:
    """Keep `concurrency` requests in flight until every prompt has run; `output_len` per
    request or one for all."""
    lengths = output_len if isinstance(output_len, list) else [output_len] * len(prompts)
    base = params or SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    records: list[RequestRecord] = []
    lock = threading.Lock()
    queue = [(p, replace(base, max_tokens=n)) for p, n in zip(prompts, lengths)]

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt, params = queue.pop(0)
            rec = RequestRecord(
                time.perf_counter(),
                num_prompt_tokens=len(prompt),
                expected_output_tokens=params.max_tokens,
            )
            for out in engine.submit(prompt, params, owner="bench"):
                now = time.perf_counter()
                rec.token_times.extend([now] * len(out.token_ids))
                rec.num_output_tokens = out.num_output_tokens
                if out.finished and out.error:
                    rec.error = out.error
            with lock:
                records.append(rec)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - started


def run_offline(
    engine: Engine,
    concurrencies: list[int],
    num_requests: int,
    input_len: int | tuple[int, int],
    output_len: int | tuple[int, int],
    seed: int = 0,
    log: Callable[[str], None] = print,
    params: SamplingParams | None = None,
) -> list[tuple[int, Summary]]:
    """Each level runs the same kind of load: `num_requests` prompts of `input_len` tokens
    (or drawn from a (MIN, MAX) range), `output_len` output tokens (likewise), ignore_eos."""
    warm = random_prompts(engine, 2, 32, seed + 999)
    closed_loop(engine, warm, 4, 2)  # first-call allocations and thread pools
    out_lo, out_hi = (output_len, output_len) if isinstance(output_len, int) else output_len
    results = []
    for c in concurrencies:
        prompts = random_prompts(engine, num_requests, input_len, seed + c)
        rng = random.Random(seed + c)
        lengths = [rng.randint(out_lo, out_hi) for _ in prompts]
        records, duration = closed_loop(engine, prompts, lengths, c, params)
        summary = summarize(records, duration)
        results.append((c, summary))
        log(
            f"C={c}: {summary.output_tok_s:.1f} output tok/s, "
            f"TTFT p50 {summary.ttft_p50 * 1000:.0f} ms, TPOT p50 {summary.tpot_p50 * 1000:.1f} ms"
        )
    return results


def markdown_table(results: list[tuple[int, Summary]]) -> str:
    lines = [
        "| concurrency | output tok/s | req/s | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) "
        "| TPOT p50 (ms) | TPOT p90 (ms) | ITL p99 (ms) | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, s in results:
        lines.append(
            f"| {c} | {s.output_tok_s:.1f} | {s.requests_s:.2f} | {s.ttft_p50 * 1e3:.0f} "
            f"| {s.ttft_p90 * 1e3:.0f} | {s.ttft_p99 * 1e3:.0f} | {s.tpot_p50 * 1e3:.1f} "
            f"| {s.tpot_p90 * 1e3:.1f} | {s.itl_p99 * 1e3:.1f} | {s.num_failed} |"
        )
    return "\n".join(lines)
