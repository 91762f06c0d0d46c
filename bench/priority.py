"""The watched stream first: one stream's time per output token alone, beside 15 busy
background streams as their equal, and beside them as the interactive one (the focused pane,
or an HTTP client sending X-Lucedesk-Priority: interactive), on the default model with the
cpu profile, all in one run.

    .venv/bin/python bench/priority.py [--model PATH] [--tokens 128] [--background 15]

TPOT is the watched stream's time per output token after its first (mean), with the median
time between two of its tokens beside it (a background step, one in `background_every`, is
the slow one). The background streams' output rate is what the watched pace costs them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from lucedesk import profile
from lucedesk.catalog.resolve import resolve
from lucedesk.engine import SamplingParams, launch_engine

PROMPT = "Write a long story about a lighthouse keeper and a storm at sea."


async def stream_times(engine, prompt: list[int], tokens: int, interactive: bool) -> list[float]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    handle = engine.submit(prompt, params, owner="watched", interactive=interactive)
    stamps = []
    async for out in handle:
        stamps.extend(time.perf_counter() for _ in out.token_ids)
    return stamps


async def background_load(engine, prompt: list[int], count: int) -> tuple[list, list[int]]:
    """`count` long greedy streams, once every one of them decodes: (their handles, the
    tokens each has streamed so far, kept current)."""
    handles, counts = [], [0] * count

    async def drain(i, handle):
        async for out in handle:
            counts[i] += len(out.token_ids)

    for i in range(count):
        params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
        handles.append(engine.submit(prompt + [i + 1], params, owner=f"background{i}"))
    for i, h in enumerate(handles):
        asyncio.ensure_future(drain(i, h))
    while sum(1 for c in counts if c > 0) < count:  # every one decoding
        await asyncio.sleep(0.05)
    return handles, counts


async def case(engine, prompt, tokens: int, background: int, interactive: bool) -> dict:
    handles, counts = await background_load(engine, prompt, background) if background else ([], [])
    before, started = sum(counts), time.perf_counter()
    stamps = await stream_times(engine, prompt, tokens, interactive)
    elapsed, made = time.perf_counter() - started, sum(counts) - before
    for handle in handles:
        handle.cancel()
    while engine.stats().num_running:
        await asyncio.sleep(0.05)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "tpot_ms": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000,
        "itl_p50_ms": statistics.median(gaps) * 1000,
        "background_tok_s": made / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--background", type=int, default=15)
    parser.add_argument("--set", action="append", default=[], help="engine key=value")
    args = parser.parse_args()
    model = resolve(args.model, print).path
    _, config, why = profile.resolve("cpu", [f"max_slots={args.background + 1}", *args.set])
    print(why, f"· background_every={config.background_every}")
    built = launch_engine(model, config)
    engine = built.engine
    prompt = engine.tokenizer.encode(PROMPT)
    try:
        asyncio.run(case(engine, prompt, 32, 0, False))  # warm-up
        rows = [
            ("alone", 0, False),
            (f"beside {args.background} busy, as their equal", args.background, False),
            (f"beside {args.background} busy, interactive", args.background, True),
        ]
        results = [
            (name, asyncio.run(case(engine, prompt, args.tokens, n, watched)))
            for name, n, watched in rows
        ]
    finally:
        engine.shutdown()
    alone = results[0][1]["tpot_ms"]
    print(
        "\n| watched stream | TPOT (ms) | vs alone | median between tokens (ms) "
        "| background output (tok/s) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, r in results:
        tpot = r["tpot_ms"]
        bg = f"{r['background_tok_s']:.1f}" if "beside" in name else "-"
        print(f"| {name} | {tpot:.1f} | {tpot / alone:.2f}x | {r['itl_p50_ms']:.1f} | {bg} |")


if __name__ == "__main__":
    main()
