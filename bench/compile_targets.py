"""Every Triton kernel compiled ahead of time for the GPUs lucedesk is for, with the
specializations the engine launches (kernels/launches.py), no GPU needed: one line per
kernel, specialization and target with its registers, spills, LDS bytes and the matrix
instructions chosen; exits 1 where any fails to compile, spills or exceeds the target's
LDS.

    .venv/bin/python bench/compile_targets.py [--target gfx1201,gfx1151,sm_90] [--json FILE]
        [--quick] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from lucedesk.kernels.compile_targets import TARGETS, compile_all


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=",".join(TARGETS), help="comma-separated targets")
    parser.add_argument("--json", help="write every result to this file")
    parser.add_argument("--quick", action="store_true", help="bf16 and the common shapes")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    targets = args.target.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target {unknown[0]!r} (one of {', '.join(TARGETS)})")
    started = time.perf_counter()
    results = compile_all(targets, args.quick, args.workers)
    width = max(len(r.kernel) + len(r.label) for r in results) + 1
    print(f"{'kernel, specialization':<{width}} {'target':<8} {'regs':>5} {'spills':>6} "
          f"{'LDS B':>7}  matrix instructions / problems")  # fmt: skip
    for r in results:
        said = "; ".join(r.problems) if r.problems else " ".join(r.matrix) or "-"
        print(f"{r.kernel + ' ' + r.label:<{width}} {r.target:<8} {r.registers:>5} "
              f"{r.spills:>6} {r.lds:>7}  {said}")  # fmt: skip
    bad = [r for r in results if not r.ok]
    seconds = time.perf_counter() - started
    print(f"\n{len(results)} compiles, {len(bad)} failed, {seconds:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
