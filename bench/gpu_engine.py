"""The engine on a GPU as the r9700 profile sets it up (bfloat16, the Triton kernels, a
GGUF file's blocks held as they are, its pool, block size and prompt chunks; 16 slots, so
that C16 runs): the offline workload of the CPU tables (256-token prompts, 128 output
tokens, ignore_eos, greedy, prompt lookup off) at C1 and C16, the memory held (weights and
KV pool), and at each level the decode step's share of the device's memory bandwidth: the
bytes a step reads (every dense matmul weight once; of a mixture's experts, those c rows
are expected to touch, each row taking k of E experts; each running sequence's K/V at the
workload's mean context) over the time per output token, against the peak.

    python bench/gpu_engine.py [--profile r9700] [--model PATH] [--peak-gbs N] [--set K=V]

One script for a lent GPU: it prints the kernels in use, a markdown table and the share.
"""

from __future__ import annotations

import argparse
import time

import torch
from cpu_step import weight_bytes
from kernels import PEAKS

from lucedesk.bench.offline import markdown_table, run_offline
from lucedesk.catalog.resolve import resolve as resolve_model
from lucedesk.engine.build import kv_bytes_per_token, launch_engine
from lucedesk.profile import resolve

SETTINGS = ["max_slots=16", "prompt_lookup=false"]  # on top of the profile's


def device_peak(device: torch.device, given: float | None) -> tuple[float | None, str]:
    """(peak GB/s, device name): --peak-gbs, else PEAKS by a fragment of the name."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if given is not None:
        return given, name
    return next((gbs for key, gbs in PEAKS.items() if key in name), None), name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="r9700")
    parser.add_argument("--model", default=None, help="a model path (default: the default model)")
    parser.add_argument("--concurrency", "-c", default="1,16")
    parser.add_argument("--num-requests", "-n", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--peak-gbs", type=float, default=None, help="the device's peak GB/s")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an engine setting"
    )
    args = parser.parse_args()

    _, config, _ = resolve(args.profile, SETTINGS + args.set)
    path = resolve_model(args.model, print).path
    started = time.perf_counter()
    built = launch_engine(path, config, print)  # as the app runs it: its own thread, warmed
    runner = built.engine.seq_engine
    model, device = runner.model, built.device
    peak, name = device_peak(device, args.peak_gbs)
    weights = weight_bytes(model)
    experts, chosen = expert_bytes(model)
    per_token = kv_bytes_per_token(built.loaded.config, built.dtype, config.kv_dtype)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    print(
        f"{path.name} on {name}: dtype {built.dtype}, kernels {runner.kernels.name}, "
        f"weights held as {built.held} ({weights / 1e6:.1f} MB of dense weights a step, "
        f"{experts / 1e6:.1f} MB of experts), K/V {per_token} bytes a token, pool "
        f"{built.pool_bytes / 2**30:.2f} GiB, {held / 2**30:.2f} GiB allocated on the device, "
        f"built in {time.perf_counter() - started:.1f} s"
    )
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        results = run_offline(
            built.engine, levels, args.num_requests, args.input_len, args.output_len
        )
    finally:
        built.engine.shutdown()
    print(markdown_table(results))
    context = args.input_len + args.output_len / 2  # a decoding sequence's mean context
    print("\n| concurrency | bytes a decode step (MB) | GB/s at TPOT p50 | share of peak |")
    print("|---:|---:|---:|---:|")
    for c, summary in results:
        step = weights + c * context * per_token
        if chosen:  # a mixture: the experts c rows touch, each taking `chosen` of E
            total = model.config.num_experts
            step += experts * (1 - (1 - chosen / total) ** c)
        rate = step / summary.tpot_p50 / 1e9
        share = f"{rate / peak:.1%}" if peak else "(peak unknown: --peak-gbs)"
        print(f"| {c} | {step / 1e6:.1f} | {rate:.0f} | {share} |")
    print(f"peak {peak} GB/s" if peak else f"no peak known for {name}")


def expert_bytes(model) -> tuple[int, int]:
    """A mixture's held expert weights' bytes (every layer's, every expert's) and the
    experts a row takes; (0, 0) for a dense model."""
    blocks = model.moe_blocks()
    if not blocks:
        return 0, 0
    held = [w for _, moe in blocks for w in moe.experts.quantized.values()]
    dense = [p for _, moe in blocks for p in (moe.experts.gate_up, moe.experts.down)]
    size = sum(w.nbytes for w in held) + sum(p.numel() * p.element_size() for p in dense)
    return size, model.config.num_experts_per_tok


if __name__ == "__main__":
    main()
