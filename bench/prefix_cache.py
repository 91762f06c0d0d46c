"""Prefix caching on the default model, in-process:

1. 32 requests sharing a ~1,500-token system prompt, concurrency 8, with and without the
   cache: wall time, TTFT p50/p90, output tok/s.
2. A 5-turn chat (each turn resends the history): TTFT per turn, cache off (cold) vs on.

    python bench/prefix_cache.py [--model PATH]
"""

from __future__ import annotations

import argparse
import random
import time

from lucedesk import profile
from lucedesk.bench.metrics import percentile, summarize
from lucedesk.bench.offline import closed_loop, random_prompts
from lucedesk.catalog.resolve import resolve
from lucedesk.chat.encoder import encode_chat
from lucedesk.engine.build import launch_engine
from lucedesk.engine.request import SamplingParams


def shared_prompt_run(model, cache: bool) -> dict:
    _, config, _ = profile.resolve("cpu", [f"prefix_cache={str(cache).lower()}"])
    built = launch_engine(model, config)
    engine = built.engine
    try:
        system = random_prompts(engine, 1, 1500, seed=1)[0]
        tails = random_prompts(engine, 32, 24, seed=2)
        prompts = [system + t for t in tails]
        closed_loop(engine, random_prompts(engine, 2, 32, 99), 4, 2)  # warm-up, no overlap
        records, wall = closed_loop(engine, prompts, 64, 8)
        s = summarize(records, wall)
        return {
            "wall_s": wall,
            "ttft_p50": s.ttft_p50,
            "ttft_p90": s.ttft_p90,
            "tok_s": s.output_tok_s,
            "computed": engine.scheduler.num_computed_prompt_tokens,
        }
    finally:
        engine.shutdown()


def chat_run(model, cache: bool) -> list[float]:
    _, config, _ = profile.resolve("cpu", [f"prefix_cache={str(cache).lower()}"])
    built = launch_engine(model, config)
    engine, tok = built.engine, built.loaded.tokenizer
    rng = random.Random(5)
    topics = [
        "the history of Rome",
        "how bridges are built",
        "the water cycle",
        "why cats purr",
        "how a CPU cache works",
    ]
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 40}]
    ttfts = []
    try:
        for topic in topics:
            messages.append({"role": "user", "content": f"Tell me about {topic}."})
            prompt = encode_chat(tok, messages)
            start = time.perf_counter()
            handle = engine.submit(
                prompt, SamplingParams(max_tokens=96, temperature=0.0, seed=rng.randrange(1000))
            )
            first = None
            for out in handle:
                if first is None and out.token_ids:
                    first = time.perf_counter() - start
            ttfts.append(first)
            messages.append({"role": "assistant", "content": handle.result().text})
    finally:
        engine.shutdown()
    return ttfts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = resolve(args.model).path
    print(
        "| prefix cache | wall (s) | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s "
        "| prompt tokens computed |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for cache in (False, True):
        r = shared_prompt_run(model, cache)
        print(
            f"| {'on' if cache else 'off'} | {r['wall_s']:.1f} | {r['ttft_p50'] * 1e3:.0f} | "
            f"{r['ttft_p90'] * 1e3:.0f} | {r['tok_s']:.1f} | {r['computed']} |",
            flush=True,
        )
    cold, warm = chat_run(model, False), chat_run(model, True)
    print("\n| turn | TTFT cache off (ms) | TTFT cache on (ms) | ratio |")
    print("|---:|---:|---:|---:|")
    for i, (c, w) in enumerate(zip(cold, warm), 1):
        print(f"| {i} | {c * 1e3:.0f} | {w * 1e3:.0f} | {c / w:.1f}x |")
    print(
        f"\nmedian TTFT over turns 2-5: off {percentile(cold[1:], 50) * 1e3:.0f} ms, "
        f"on {percentile(warm[1:], 50) * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
