"""Prompt-lookup speculation on an edit workload: the prompt holds a ~300-line source file,
the reply writes the file out again with one small change. The same engine answers with
prompt lookup off and on, alternating A B B A, greedy, at each concurrency; every reply must
be the same text both ways.

    .venv/bin/python bench/edit_speed.py [--model PATH] [-c 1,4] [--output-len 1024]
        [--set KEY=VALUE ...]

The source is a file of Python's standard library (shlex.py by default: fixed for a Python
version, ~350 lines); each concurrent request renames a different identifier in it. Output
tok/s is output tokens over the wall time of the level; decode tok/s per request is output
tokens after the first over the time from the first to the last.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import threading
import time
from pathlib import Path

from lucedesk import profile
from lucedesk.catalog.resolve import resolve
from lucedesk.chat import ChatEncoder
from lucedesk.engine import SamplingParams, launch_engine

RENAMES = [
    ("shlex", "Lexer"),
    ("quote", "shell_quote"),
    ("split", "split_words"),
    ("join", "join_words"),
]


def prompts(source: str, count: int) -> list[list[dict]]:
    out = []
    for i in range(count):
        old, new = RENAMES[i % len(RENAMES)]
        out.append(
            [
                {
                    "role": "user",
                    "content": f"```python\n{source}```\n\nWrite the file above again with "
                    f"`{old}` renamed to `{new}`.",
                }
            ]
        )
    return out


def run_level(engine, chats: list[list[dict]], output_len: int, speculative: bool) -> dict:
    """All chats at once; returns texts, output tok/s, TTFT and decode tok/s medians."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, speculative=speculative)
    before = engine.stats()
    started = time.perf_counter()
    handles = [engine.submit(ChatEncoder.of(engine).encode(c).token_ids, params) for c in chats]
    firsts: list[float] = [0.0] * len(handles)
    lasts: list[float] = [0.0] * len(handles)

    def read(i: int) -> None:
        for out in handles[i]:
            now = time.perf_counter()
            if out.token_ids and not firsts[i]:
                firsts[i] = now
            if out.token_ids:
                lasts[i] = now

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    results = [h.result(timeout=0) for h in handles]
    after = engine.stats()
    tokens = [len(r.token_ids) for r in results]
    decode = [(n - 1) / (lasts[i] - firsts[i]) for i, n in enumerate(tokens) if n > 1]
    drafted = after.draft_tokens - before.draft_tokens
    kept = after.accepted_tokens - before.accepted_tokens
    rows = after.draft_rows - before.draft_rows
    return {
        "texts": [r.text for r in results],
        "output_tokens": sum(tokens),
        "tok_s": sum(tokens) / wall,
        "decode_tok_s": statistics.median(decode),
        "ttft_ms": statistics.median((f - started) * 1000 for f in firsts),
        "acceptance": kept / drafted if drafted else 0.0,
        "tokens_per_row": 1 + kept / rows if rows else 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--source", default=shlex.__file__, help="the file to edit")
    parser.add_argument("-c", "--concurrency", default="1,4")
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a profile setting"
    )
    args = parser.parse_args()
    source = Path(args.source).read_text()
    model = resolve(args.model, print).path
    _, config, why = profile.resolve(
        "cpu", ["kv_pool_tokens=65536", "max_model_len=8192", *args.set]
    )
    print(why, f"; {args.source}: {len(source.splitlines())} lines", flush=True)
    built = launch_engine(model, config)
    engine = built.engine
    print(
        "| concurrency | prompt lookup | output tok/s | decode tok/s (median) | TTFT p50 (ms) "
        "| drafts kept | tokens per draft row | output tokens |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    summary = []
    try:
        run_level(engine, prompts(source, 1), 32, False)  # warm-up (and the prefix cache)
        for c in [int(x) for x in args.concurrency.split(",")]:
            chats = prompts(source, c)
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for on in (False, True, True, False):
                runs[on].append(run_level(engine, chats, args.output_len, on))
            texts = {tuple(r["texts"]) for r in runs[False] + runs[True]}
            assert len(texts) == 1, "prompt lookup changed a reply"
            for on in (False, True):
                rs = runs[on]
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "texts"}
                print(
                    f"| {c} | {'on' if on else 'off'} | {med['tok_s']:.1f} "
                    f"| {med['decode_tok_s']:.1f} | {med['ttft_ms']:.0f} "
                    f"| {med['acceptance']:.0%} | {med['tokens_per_row']:.2f} "
                    f"| {med['output_tokens']:.0f} |",
                    flush=True,
                )
                summary.append((c, on, med["tok_s"]))
        for c in sorted({s[0] for s in summary}):
            off = next(v for cc, on, v in summary if cc == c and not on)
            on = next(v for cc, o, v in summary if cc == c and o)
            print(f"C{c}: prompt lookup on / off = {on / off:.2f}x output tok/s, same text")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
