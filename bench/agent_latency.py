"""What an agent session waits for, on the cpu profile, all in one run:

1. stall-free steps: one stream's time per token alone, and while another request's long
   prompt (6,000 tokens) prefills beside it, with the fixed prompt chunk
   (decode_slowdown = 0) and with paced chunks (the profile's decode_slowdown), in turns
   (ABAB); and that prompt's time to first token in each case;
2. background work under focus: a watched stream decodes while a background stream and a
   background long prompt wait behind it; the longest wait either saw between two of its
   steps (what the monitor's wait column shows), and the prompt's time to first token;
3. the prefix cache on disk: the time to first token of a long prompt cold, and after the
   engine is built again in a new process with the disk cache it left (see --restart).

    .venv/bin/python bench/agent_latency.py [--model PATH] [--prompt 6000] [--rounds 2]
    .venv/bin/python bench/agent_latency.py --restart [--model gemma3-270m --prompt 20000]

Medians of `--rounds` turns; the ratios are of numbers from this one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lucedesk import profile
from lucedesk.catalog.resolve import resolve
from lucedesk.engine import SamplingParams, launch_engine
from lucedesk.engine.pacing import StepPacer

STREAM = "Write a long story about a lighthouse keeper and a storm at sea."


def long_prompt(engine, tokens: int, seed: int) -> list[int]:
    """`tokens` ids of text-like tokens, different from the first block on for each seed."""
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    return [rng.randrange(100, min(vocab, 40_000)) for _ in range(tokens)]


async def stream_beside(engine, stream: list[int], prompt: list[int] | None) -> dict:
    """A stream decodes; once it has 16 tokens, `prompt` (if any) is submitted. Returns the
    stream's mean time per token over the prompt's prefill (or over 64 tokens alone) and
    the prompt's TTFT."""
    # Drafts off: a time per token of one step each (a draft row's tokens come in bursts).
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True, speculative=False)
    handle = engine.submit(stream, params, owner="stream", interactive=False)
    stamps: list[float] = []
    first: list[float] = []
    submitted = 0.0

    async def long_request():
        nonlocal submitted
        submitted = time.perf_counter()
        h = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0), owner="long")
        async for out in h:
            if out.token_ids and not first:
                first.append(time.perf_counter())

    task = None
    async for out in handle:
        stamps.extend(time.perf_counter() for _ in out.token_ids)
        if len(stamps) >= 16 and prompt is not None and task is None:
            task = asyncio.ensure_future(long_request())
            mark = len(stamps)
        if prompt is None and len(stamps) >= 80:
            break
        if first:
            break
    handle.cancel()
    if task is not None:
        await task
    while engine.stats().num_running:
        await asyncio.sleep(0.02)
    if prompt is None:
        window = stamps[16:]
        return {"tpot_ms": (window[-1] - window[0]) / (len(window) - 1) * 1000}
    window = [t for t in stamps[mark:] if t <= first[0]]
    return {
        "tpot_ms": (window[-1] - window[0]) / max(len(window) - 1, 1) * 1000,
        "ttft_s": first[0] - submitted,
        "tokens": len(window),
    }


def stall_free(engine, config, prompt_tokens: int, rounds: int, slowdowns) -> list[str]:
    stream = engine.tokenizer.encode(STREAM)
    least = min(config.block_size, config.prefill_chunk_idle)
    pacers = {"fixed": None} | {
        f"paced, {x:g}x or {ms} ms": StepPacer(x, least, config.prefill_chunk_idle, ms / 1000)
        for x, ms in slowdowns
    }
    sched = engine.scheduler
    default = sched.pacer
    asyncio.run(stream_beside(engine, stream, None))  # warm-up
    results: dict[str, list[dict]] = {name: [] for name in ["alone", *pacers]}
    seed = 0
    for r in range(rounds):
        for name in list(pacers) if r % 2 == 0 else list(pacers)[::-1]:
            sched.pacer = pacers[name]
            seed += 1
            prompt = long_prompt(engine, prompt_tokens, seed)
            results[name].append(asyncio.run(stream_beside(engine, stream, prompt)))
        results["alone"].append(asyncio.run(stream_beside(engine, stream, None)))
    sched.pacer = default

    def med(name, key):
        return statistics.median(x[key] for x in results[name])

    alone = med("alone", "tpot_ms")
    fixed_ttft = med("fixed", "ttft_s")
    lines = [
        f"\n1. One stream (drafts off) beside a {prompt_tokens}-token prompt (medians of "
        f"{rounds}; the fixed chunk is prefill_chunk_decoding, {config.prefill_chunk_decoding}):\n",
        "| | stream TPOT (ms) | vs alone | the prompt's TTFT (s) | vs fixed |",
        "|---|---:|---:|---:|---:|",
        f"| stream alone | {alone:.1f} | 1.00x | | |",
    ]
    for name in pacers:
        tpot, ttft = med(name, "tpot_ms"), med(name, "ttft_s")
        lines.append(
            f"| beside the prompt, {name} | {tpot:.1f} | {tpot / alone:.2f}x "
            f"| {ttft:.2f} | {ttft / fixed_ttft:.2f}x |"
        )
    return lines


async def background_under_focus(engine, prompt_tokens: int) -> dict:
    """A watched stream decodes 200 tokens; a background stream and a background long
    prompt are submitted beside it. The longest wait each background request shows in the
    engine's stats while the watched stream runs, and the background prompt's TTFT."""
    stream = engine.tokenizer.encode(STREAM)
    ignore = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    bg = engine.submit(stream + [7], ignore, owner="bg-stream")
    watched = engine.submit(
        stream, SamplingParams(200, temperature=0.0, ignore_eos=True), interactive=True
    )
    submitted = time.perf_counter()
    long = engine.submit(
        long_prompt(engine, prompt_tokens, 99), SamplingParams(max_tokens=4000, ignore_eos=True)
    )
    waits = {"bg-stream": 0.0, "long": 0.0}
    made = {"bg": 0}
    first: list[float] = []
    computed = 0

    async def drain(handle, key):
        async for out in handle:
            made[key] = made.get(key, 0) + len(out.token_ids)
            if key == "long" and out.token_ids and not first:
                first.append(time.perf_counter() - submitted)

    tasks = [asyncio.ensure_future(drain(bg, "bg")), asyncio.ensure_future(drain(long, "long"))]
    started = time.perf_counter()
    async for _ in watched:
        for slot in engine.stats().slots:
            owner = "long" if slot.request_id == long.request_id else slot.owner
            if owner in waits and slot.wait_s is not None:
                waits[owner] = max(waits[owner], slot.wait_s)
            if owner == "long":
                computed = max(computed, slot.computed_tokens)
        await asyncio.sleep(0)
    elapsed = time.perf_counter() - started
    bg.cancel()
    long.cancel()
    await asyncio.gather(*tasks)
    return {
        "watched_s": elapsed,
        "bg_tok_s": made["bg"] / elapsed,
        "bg_wait_s": waits["bg-stream"],
        "long_wait_s": waits["long"],
        "long_ttft_s": first[0] if first else None,
        "long_computed": computed,
    }


def background(engine, config, prompt_tokens: int) -> list[str]:
    r = asyncio.run(background_under_focus(engine, prompt_tokens))
    ttft = (
        f"TTFT {r['long_ttft_s']:.2f} s"
        if r["long_ttft_s"]
        else f"{r['long_computed']} prompt tokens computed meanwhile"
    )
    return [
        f"\n2. A watched stream of 200 tokens ({r['watched_s']:.1f} s) with a background "
        f"stream and a background {prompt_tokens}-token prompt beside it "
        f"(background_every {config.background_every}):\n",
        "| | longest wait between steps (s) | output / first token |",
        "|---|---:|---:|",
        f"| background stream | {r['bg_wait_s']:.2f} | {r['bg_tok_s']:.1f} tok/s |",
        f"| background prompt | {r['long_wait_s']:.2f} | {ttft} |",
    ]


def child(model: str, sets: list[str], prompt_tokens: int, settle: bool) -> None:
    """One process: build the engine, time one long prompt's first token, print JSON. With
    `settle`, the prompt is sent once the engine's start-up work (the grammar library's
    view of the vocabulary, built on a thread) is done."""
    _, config, _ = profile.resolve("cpu", sets)
    started = time.perf_counter()
    engine = launch_engine(model, config).engine
    ready = time.perf_counter() - started
    if settle:
        engine._warming.join()
    prompt = long_prompt(engine, prompt_tokens, seed=12345)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, speculative=False)
    submitted = time.perf_counter()
    handle = engine.submit(prompt, params)
    tokens, first = [], None

    async def drain():
        nonlocal first
        async for out in handle:
            if out.token_ids and first is None:
                first = time.perf_counter() - submitted
            tokens.extend(out.token_ids)

    asyncio.run(drain())
    stats = engine.stats()
    engine.shutdown()  # the write to disk finishes first
    print(
        json.dumps(
            {
                "ready_s": ready,
                "ttft_s": first,
                "tokens": tokens,
                "disk_hit_tokens": stats.prefix_disk_hit_tokens,
            }
        )
    )


def restart(model: str, sets: list[str], prompt_tokens: int, rounds: int) -> list[str]:
    """Per round, a new empty cache folder: a cold process, then a second one after it."""
    cases = {
        "cold (sent once started)": False,
        "after a restart, sent once started": False,
        "after a restart, sent after the start-up work": True,
    }
    results: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            env = dict(os.environ, LUCEDESK_KV_CACHE=folder)
            for name, settle in cases.items():
                command = [sys.executable, __file__, "--child", "--model", model]
                command += ["--prompt", str(prompt_tokens)] + [f"--set={s}" for s in sets]
                command += ["--settle"] if settle else []
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold = next(iter(results.values()))
    same = all(a["tokens"] == b["tokens"] for runs in results.values() for a, b in zip(cold, runs))
    cold_ttft = statistics.median(r["ttft_s"] for r in cold)
    lines = [
        f"\n3. A {prompt_tokens}-token prompt's first token in a new process, with the prefix "
        f"cache on disk empty and after a process that computed it (medians of {rounds}; "
        f"{Path(model).name}; same 16 greedy tokens: {same}):\n",
        "| | TTFT (s) | vs cold | tokens read from disk | ready (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        ttft = statistics.median(r["ttft_s"] for r in runs)
        ready = statistics.median(r["ready_s"] for r in runs)
        hits = statistics.median(r["disk_hit_tokens"] for r in runs)
        lines.append(
            f"| {name} | {ttft:.2f} | {ttft / cold_ttft:.2f}x | {hits:.0f} | {ready:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt", type=int, default=6000, help="long prompt tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--pace", action="append", default=[], help="SLOWDOWN,STEP_MS: a pacing to compare"
    )
    parser.add_argument("--restart", action="store_true", help="only 3: the disk cache")
    parser.add_argument("--set", action="append", default=[], help="engine key=value")
    parser.add_argument("--skip-1", action="store_true", help="only 2 (and not 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--settle", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = str(resolve(args.model, print).path)
    sets = [f"max_model_len={max(8192, args.prompt + 4096)}", *args.set]
    if args.child:
        return child(model, sets, args.prompt, args.settle)
    if args.restart:
        return print("\n".join(restart(model, sets, args.prompt, args.rounds)))
    _, config, why = profile.resolve("cpu", sets)
    print(why)
    built = launch_engine(model, config)
    engine = built.engine
    try:
        paces = [(float(a), int(b)) for a, b in (p.split(",") for p in args.pace)]
        slowdowns = paces or [(config.decode_slowdown, config.decode_step_ms)]
        lines = (
            [] if args.skip_1 else stall_free(engine, config, args.prompt, args.rounds, slowdowns)
        )
        lines += background(engine, config, args.prompt // 2)
    finally:
        engine.shutdown()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
