"""The memory estimate a model's fit is checked with (catalog/fit.py) against what loading
it really takes: each model in a fresh process, the resident memory after the imports and
after the engine is serving (weights in their final form, the KV pool, the kernels and the
vocabulary warm-up), and the peak between.

    .venv/bin/python bench/model_fit.py [--model NAME ...] [--set KEY=VALUE ...] [--write-docs]

The pool here is the profile's as the engine derives it (the cpu profile: a tenth of the
memory free after the weights), so the estimate is taken with the same free memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"
SECTION = "## Memory: the fit estimate against what a load takes"
MODELS = ["smollm2-135m", "gemma3-270m"]


def status_bytes(key: str, file: str = "/proc/self/status") -> int:
    for line in Path(file).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def anonymous() -> int:
    return status_bytes("Anonymous", "/proc/self/smaps_rollup")


def child(name: str, overrides: list[str]) -> dict:
    import torch  # noqa: F401  (every lucedesk process has it before a model loads)

    from lucedesk import profile
    from lucedesk.catalog.fit import estimate
    from lucedesk.catalog.resolve import resolve
    from lucedesk.catalog.summary import summarize_path
    from lucedesk.engine import (
        available_memory,
        dtype_name,
        launch_engine,
        resolve_device,
        resolve_dtype,
    )

    _, config, _ = profile.resolve(None, overrides)
    model = resolve(name, lambda line: None)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    summary = summarize_path(model.path)
    before, anon = status_bytes("VmRSS"), anonymous()
    free = available_memory(device, config.unified_memory)
    need = estimate(summary, config, device.type, dtype_name(dtype), free)
    started = time.perf_counter()
    built = launch_engine(model.path, config, name=model.name)
    if built.engine._warming is not None:
        built.engine._warming.join()
    seconds = time.perf_counter() - started
    after, peak, anon = status_bytes("VmRSS"), status_bytes("VmHWM"), anonymous() - anon
    built.engine.shutdown()
    return {
        "name": name,
        "file_bytes": summary.size_bytes,
        "params": summary.params,
        "form": need.weight_format,
        "weights": need.weights,
        "kv": need.kv,
        "kv_tokens": need.kv_tokens,
        "pool_tokens": built.pool_tokens,
        "reserve": need.reserve,
        "estimate": need.total,
        "growth": after - before,
        "anonymous": anon,
        "peak": peak - before,
        "seconds": seconds,
    }


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | weights (form) | KV pool | reserve | estimate | RSS growth | "
        "estimate / growth | of it anonymous | peak growth |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {mib(r['weights'])} MiB ({r['form']}) | {mib(r['kv'])} MiB "
            f"({r['kv_tokens']:,} tokens; engine {r['pool_tokens']:,}) | {mib(r['reserve'])} MiB "
            f"| {mib(r['estimate'])} MiB | {mib(r['growth'])} MiB | "
            f"{r['estimate'] / r['growth']:.2f} | {mib(r['anonymous'])} MiB | "
            f"{mib(r['peak'])} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", action="append", help="(repeatable) default: " + ", ".join(MODELS)
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--write-docs", action="store_true", help=f"update '{SECTION}'")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.set)))
        return
    rows = []
    for name in args.model or MODELS:
        sets = [a for s in args.set for a in ("--set", s)]
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, *sets],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{name}: estimate {mib(r['estimate'])} MiB, growth {mib(r['growth'])} MiB "
            f"({r['estimate'] / r['growth']:.2f}x), peak {mib(r['peak'])} MiB",
            file=sys.stderr,
        )
    report = table(rows)
    print(report)
    if args.write_docs:
        from llama_cpp_peer import replace_section

        command = "python bench/model_fit.py " + " ".join(sys.argv[1:])
        section = (
            f"{SECTION}\n\n"
            "Before a model loads, lucedesk estimates what it will take (catalog/fit.py: the\n"
            "weights in the form the engine holds them, the KV pool, the profile's\n"
            "`activation_reserve_mb`) and refuses one that cannot fit. Measured against a real\n"
            "load, each model in a fresh process: the resident memory from after the imports\n"
            "to the engine serving (weights in their final form, the KV pool, the C++ kernels,\n"
            "the vocabulary warm-up), and its peak between (`"
            + command.strip()
            + "`, the\ncpu profile, this 2-core machine, "
            + time.strftime("%Y-%m-%d")
            + "):\n\n"
            + report
            + "\n"
        )
        DOCS.write_text(replace_section(DOCS.read_text(), section))
        print(f"wrote '{SECTION}' in {DOCS}", file=sys.stderr)


if __name__ == "__main__":
    main()
