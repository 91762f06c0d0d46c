"""Quality screen of the 8-bit KV cache against the model-dtype cache, on the CPU profile's
settings (bf16, C++ kernels, the file's 4-bit weights):

1. Logprob drift: teacher-forced over Python's own standard library sources (concatenated),
   the log-probability of each actual next token with either cache: mean, p99 and max of
   |difference|, and how often the top choice agrees.
2. Retrieval: a pass key placed at several depths of filler text, the model asked for it
   (raw continuation, greedy): found or not with each cache.

    python bench/kv_quality.py --model PATH --tokens 4096 [--markdown out.md]

The speed side is `lucedesk bench --offline ... --set kv_dtype=dtype|int8` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from lucedesk import profile
from lucedesk.catalog.resolve import resolve
from lucedesk.engine.build import assemble, build_engine
from lucedesk.engine.request import SamplingParams
from lucedesk.engine.runner import TorchSeqEngine
from lucedesk.engine.scoring import score_tokens

STDLIB_FILES = ("argparse.py", "typing.py", "dataclasses.py", "functools.py", "pathlib.py")
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
PASS_KEY = "68231"
NEEDLE = f"The pass key is {PASS_KEY}. Remember it. {PASS_KEY} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)


def stdlib_tokens(tokenizer, n: int) -> list[int]:
    """The first n tokens of some of the standard library's own source files."""
    folder = Path(os.__file__).parent
    text = "\n\n".join((folder / name).read_text() for name in STDLIB_FILES)
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the sources give {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def drift(built, n: int, chunk: int) -> dict[str, float]:
    tokens = stdlib_tokens(built.loaded.tokenizer, n)
    scores, seconds = {}, {}
    for kv_dtype in ("dtype", "int8"):
        runner = TorchSeqEngine(
            built.loaded.model, n // 16 + 1, 16, built.kernels, built.device, kv_dtype
        )
        started = time.perf_counter()
        scores[kv_dtype] = score_tokens(runner, tokens, chunk=chunk)
        seconds[kv_dtype] = time.perf_counter() - started
        del runner
    diff = (scores["int8"].logprobs - scores["dtype"].logprobs).abs()
    return {
        "tokens": n,
        "mean": diff.mean().item(),
        "p99": diff.quantile(0.99).item(),
        "max": diff.max().item(),
        "agree": (scores["int8"].top1 == scores["dtype"].top1).float().mean().item(),
        "nll_dtype": -scores["dtype"].logprobs.mean().item(),
        "nll_int8": -scores["int8"].logprobs.mean().item(),
        "s_dtype": seconds["dtype"],
        "s_int8": seconds["int8"],
    }


def retrieval_prompt(tokenizer, n: int, depth: float) -> list[int]:
    """About n tokens of filler with the needle at `depth` of it, then the question."""
    per = len(tokenizer.encode(FILLER))
    reps = max(1, (n - 64) // per)
    before = int(reps * depth)
    text = FILLER * before + NEEDLE + FILLER * (reps - before) + QUESTION
    return tokenizer.encode(text)


def retrieval(engine, tokenizer, n: int) -> list[tuple[float, bool, str]]:
    found = []
    for depth in DEPTHS:
        prompt = retrieval_prompt(tokenizer, n, depth)
        handle = engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.0))
        while not handle.finished:
            engine.step()
        text = handle.result(timeout=0).text
        found.append((depth, PASS_KEY in text, text.strip().replace("\n", " ")))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or a pulled name")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512, help="prompt chunk size")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    model = resolve(args.model).path
    pool = args.tokens + 256
    overrides = [f"kv_pool_tokens={pool}", "max_slots=1", f"max_model_len={pool}"]
    _, config, _ = profile.resolve("cpu", overrides)
    built = build_engine(model, config)
    torch.manual_seed(0)
    d = drift(built, args.tokens, args.chunk)
    found = {"dtype": retrieval(built.engine, built.loaded.tokenizer, args.tokens)}
    eight = assemble(built.loaded, config.replace(kv_dtype="int8"), built.device)
    found["int8"] = retrieval(eight.engine, built.loaded.tokenizer, args.tokens)
    name = Path(model).name
    lines = [
        f"{name}, {args.tokens} tokens, {str(built.dtype).removeprefix('torch.')}, "
        f"{built.weights} weights, {built.kernels} kernels",
        "",
        "| drift (int8 vs dtype KV) | mean abs | p99 abs | max abs | top-1 agree | "
        "NLL dtype | NLL int8 |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| stdlib source, {d['tokens']} tokens | {d['mean']:.4f} | {d['p99']:.3f} | "
        f"{d['max']:.2f} | {100 * d['agree']:.1f}% | {d['nll_dtype']:.3f} | "
        f"{d['nll_int8']:.3f} |",
        "",
        "| pass key depth | dtype KV | int8 KV |",
        "|---|---|---|",
    ]
    for (depth, ok_d, text_d), (_, ok_i, text_i) in zip(found["dtype"], found["int8"]):
        lines.append(
            f"| {depth:.0%} | {'found' if ok_d else 'missed'} ({text_d!r}) | "
            f"{'found' if ok_i else 'missed'} ({text_i!r}) |"
        )
    lines.append("")
    lines.append(f"scoring time: dtype {d['s_dtype']:.1f} s, int8 {d['s_int8']:.1f} s")
    out = "\n".join(lines)
    print(out)
    if args.markdown:
        Path(args.markdown).write_text(out + "\n")


if __name__ == "__main__":
    main()
