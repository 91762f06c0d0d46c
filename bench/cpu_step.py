"""One decode step of one stream on the CPU kernels against its bandwidth floor: the model's
forward and LM head on one row at a given context, timed over many steps, beside the time
it takes this machine to read the step's weight bytes once (a memory-bound sum over a
buffer larger than the caches). Three ways alternate in one run, so the ratios between
them are not the machine's drift: all layers as one C++ call (the layer stack), each
layer's fused calls from Python, and the separate calls.

    python bench/cpu_step.py [--model PATH] [--context 256] [--rounds 6] [--steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lucedesk.catalog.resolve import resolve as resolve_model
from lucedesk.engine.build import build_engine
from lucedesk.engine.runner import PagedAttention
from lucedesk.kernels.metadata import AttentionMetadata
from lucedesk.profile import resolve


def weight_bytes(model) -> int:
    """Bytes a one-row step reads of the matmul weights: every layer's projections and the
    LM head, as held (in the model dtype where they are not quantized)."""
    if model.weight_format == "dtype":
        return sum(w.numel() * w.element_size() for w in model.projection_weights())
    held = [w for layer in model.layers for w in layer.quantized.values()]
    held.append(model.lm_head_quantized)
    return sum(w.nbytes for w in held if w is not None)


def read_bandwidth(size: int = 1 << 30, repeats: int = 9) -> float:
    """Bytes per second of a sum over `size` bytes (median of `repeats`)."""
    buffer = torch.ones(size // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return size / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--context", type=int, default=256, help="tokens already cached")
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the ways")
    parser.add_argument("--steps", type=int, default=100, help="steps timed per round")
    args = parser.parse_args()

    _, config, _ = resolve(args.profile)
    path = resolve_model(args.model, print).path
    built = build_engine(path, config)
    runner = built.engine.seq_engine
    model = runner.model
    blocks = -(-(args.context + 1) // runner.block_size)
    meta = AttentionMetadata.build(
        [1], [args.context + 1], [list(range(blocks))], runner.block_size, 1
    )
    attention = PagedAttention(runner.kernels, runner.caches, meta, runner.scale)
    ids, positions = torch.tensor([42]), torch.tensor([args.context])

    def step() -> None:
        with torch.inference_mode():
            model.compute_logits(model(ids, positions, attention))

    fused = [(layer.fused_input, layer.fused_mlp) for layer in model.layers]
    num_fused = sum(a is not None and b is not None for a, b in fused)
    stack = model.stack

    def timed(way: str) -> float:
        model.stack = stack if way == "stack" else None
        for layer, (first, second) in zip(model.layers, fused):
            layer.fused_input = first if way != "separate" else None
            layer.fused_mlp = second if way != "separate" else None
        for _ in range(5):
            step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    ways = ["stack", "fused", "separate"] if stack is not None else ["fused", "separate"]
    steps: dict[str, list[float]] = {way: [] for way in ways}
    bandwidth = []
    for _ in range(args.rounds):
        for way in ways:
            steps[way].append(timed(way))
        bandwidth.append(read_bandwidth())
    nbytes = weight_bytes(model)
    rate = statistics.median(bandwidth)
    floor = nbytes / rate
    print(
        f"{path.name}: weights {model.weight_format}, kernels {runner.kernels.name}, "
        f"{num_fused} of {len(model.layers)} layers fused, context {args.context}"
    )
    print(f"weight bytes a step: {nbytes / 1e6:.1f} MB; read bandwidth {rate / 1e9:.1f} GB/s")
    print("| | ms a step (median) | x floor |\n|---|---:|---:|")
    print(f"| floor | {floor * 1e3:.2f} | 1.00 |")
    labels = {"stack": "layer stack", "fused": "fused calls", "separate": "separate calls"}
    medians = {way: statistics.median(times) for way, times in steps.items()}
    for way, value in medians.items():
        print(f"| {labels[way]} | {value * 1e3:.2f} | {value / floor:.2f} |")
    for way in ways[:-1]:
        print(f"{labels[way]} / separate calls: {medians[way] / medians['separate']:.2f}")


if __name__ == "__main__":
    main()
