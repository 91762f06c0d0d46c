"""Times the C++ CPU kernels against their torch references on this machine:

- paged decode attention (blocks read in place) against the torch path (gather + matmuls),
- the low-bit matmuls (q4: 4-bit projections and an 8-bit LM head, as the `q4` format holds
  the default model; int8: AMX tiles where present, else 8-bit VNNI) against bf16
  `F.linear` over a whole decode step's weights (the default model's shapes, every weight
  distinct, so each step streams them from memory as the engine does),
- residual add + RMSNorm and rotary against their torch references.

    python bench/cpu_kernels.py [--markdown out.md]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from lucedesk.kernels.attention_torch import paged_attention_torch
from lucedesk.kernels.cpu import add_rms_norm_cpu, paged_attention_cpu, rotary_cpu
from lucedesk.kernels.layers_torch import add_rms_norm_torch, rotary_torch
from lucedesk.kernels.metadata import AttentionMetadata
from lucedesk.kernels.quantized import Int8Weight, LowBitWeight, int8_tiles_available

# SmolLM2-135M: 30 layers of these [N, K] projections, then the 49,152-token LM head.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS = 30
LM_HEAD = (49152, 576)


def timed(fn, iters: int = 20) -> float:
    """Median milliseconds per call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def decode_case(batch, context, heads, kv_heads, head_dim):
    blocks_per_seq = -(-context // 16)
    num_blocks = batch * blocks_per_seq + 8
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)  # scattered blocks, as after many admissions
    tables = [order[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, 16, batch)
    k = torch.randn(kv_heads, num_blocks, 16, head_dim).bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, head_dim).bfloat16()
    return q, k, v, meta


def attention_rows() -> list[str]:
    rows = []
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):
        for batch, context in ((1, 512), (1, 4096), (16, 512), (16, 2048)):
            q, k, v, meta = decode_case(batch, context, heads, kv_heads, head_dim)
            scale = head_dim**-0.5
            t_cpu = timed(lambda: paged_attention_cpu(q, k, v, meta, scale))  # noqa: B023
            t_torch = timed(lambda: paged_attention_torch(q, k, v, meta, scale))  # noqa: B023
            gbs = 2 * batch * context * kv_heads * head_dim * 2 / (t_cpu * 1e-3) / 1e9
            rows.append(
                f"| decode attention {heads}/{kv_heads} heads, head_dim {head_dim} | "
                f"batch {batch}, context {context} | {t_cpu:.3f} | {t_torch:.3f} | "
                f"{t_torch / t_cpu:.1f}x | {gbs:.1f} |"
            )
            print(rows[-1], flush=True)
    return rows


def four_bit(w: torch.Tensor) -> LowBitWeight:
    """A weight as a Q4_1 file holds it: 4-bit levels, min and scale per 32 inputs."""
    n, k = w.shape
    groups = w.float().view(n, k // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).clamp(min=1e-8)
    levels = torch.round((groups - low[..., None]) / d[..., None]).clamp(0, 15)
    return LowBitWeight(levels.to(torch.uint8).view(n, k), d, low, bits=4)


def matmul_rows() -> list[str]:
    torch.manual_seed(0)
    bf16 = [
        [torch.randn(n, k).mul_(0.05).bfloat16() for n, k in LAYER_SHAPES]
        for _ in range(NUM_LAYERS)
    ]
    bf16_head = torch.randn(*LM_HEAD).mul_(0.05).bfloat16()
    # int8 as `weights = "int8"` builds it on this machine (engine/build.py)
    int8 = Int8Weight if int8_tiles_available() else LowBitWeight.from_float
    formats = {
        "q4": ([[four_bit(w) for w in layer] for layer in bf16], LowBitWeight.from_float),
        "int8": ([[int8(w) for w in layer] for layer in bf16], int8),
    }
    formats = {name: (layers, make(bf16_head)) for name, (layers, make) in formats.items()}
    total_bf16 = sum(w.numel() * 2 for layer in bf16 for w in layer) + bf16_head.numel() * 2
    rows = []
    for m in (1, 4, 16, 64, 256):
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        heads_in = xs[576][: min(m, 16)].contiguous()  # the LM head sees decode rows only

        def run_bf16():
            for layer in bf16:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)  # noqa: B023
            F.linear(heads_in, bf16_head)  # noqa: B023

        t_bf16 = timed(run_bf16, 10)
        for name, (layers, head) in formats.items():

            def run():
                for layer in layers:  # noqa: B023
                    for w in layer:
                        w(xs[w.shape[1]])  # noqa: B023
                head(heads_in)  # noqa: B023

            t = timed(run, 10)
            total = sum(w.nbytes for layer in layers for w in layer) + head.nbytes
            rows.append(
                f"| a decode step's matmuls, {name} (default model) | {m} rows | {t:.2f} | "
                f"{t_bf16:.2f} | {t_bf16 / t:.1f}x | {total / (t * 1e-3) / 1e9:.1f} |"
            )
            print(rows[-1], f"({total / 1e6:.0f} MB)", flush=True)
    print(f"weights: bf16 {total_bf16 / 1e6:.0f} MB")
    return rows


def layer_rows() -> list[str]:
    rows = []
    for n in (1, 16, 512):
        x, res = torch.randn(n, 576).bfloat16(), torch.randn(n, 576).bfloat16()
        w = torch.ones(576).bfloat16()
        t_cpu = timed(lambda: add_rms_norm_cpu(x, res, w, 1e-5), 200)  # noqa: B023
        t_torch = timed(lambda: add_rms_norm_torch(x, res, w, 1e-5), 200)  # noqa: B023
        rows.append(
            f"| add + rms_norm, hidden 576 | {n} rows | {t_cpu:.4f} | {t_torch:.4f} | "
            f"{t_torch / t_cpu:.1f}x | |"
        )
        qkv = torch.randn(n, 960).bfloat16()
        q, k = qkv[:, :576].view(n, 9, 64), qkv[:, 576:768].view(n, 3, 64)
        cos, sin = torch.randn(n, 64).bfloat16(), torch.randn(n, 64).bfloat16()
        t_cpu = timed(lambda: rotary_cpu(q, k, cos, sin), 200)  # noqa: B023
        t_torch = timed(lambda: rotary_torch(q, k, cos, sin), 200)  # noqa: B023
        rows.append(
            f"| rotary, 9/3 heads of 64 | {n} rows | {t_cpu:.4f} | {t_torch:.4f} | "
            f"{t_torch / t_cpu:.1f}x | |"
        )
        print("\n".join(rows[-2:]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    lines = [
        f"CPU threads: {torch.get_num_threads()}, bf16",
        "",
        "| kernel | shape | C++ ms | torch ms | speed-up | C++ GB/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += attention_rows() + matmul_rows() + layer_rows()
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
