"""Times the Triton kernels against their torch references and against
scaled_dot_product_attention on gathered (contiguous) tensors, on a GPU, and prints the
achieved bandwidth of the decode attention, norm and rotary kernels against the device's
peak.

    python bench/kernels.py [--peak-gbs 4800] [--dtype bfloat16] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

from lucedesk.kernels.attention_torch import paged_attention_torch, write_kv_torch
from lucedesk.kernels.attention_triton import paged_attention
from lucedesk.kernels.kv_write_triton import write_kv
from lucedesk.kernels.layers_torch import add_rms_norm_torch, rotary_torch
from lucedesk.kernels.layers_triton import add_rms_norm_triton, rotary_triton
from lucedesk.kernels.metadata import AttentionMetadata

# Peak memory bandwidth (GB/s) by device name fragment.
PEAKS = {"H200": 4800, "H100": 3350, "A100": 2039, "R9700": 640, "8060S": 256, "MI300": 5300}


def timed(fn, iters: int = 50) -> float:
    """Median milliseconds per call, measured with CUDA events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def decode_batch(batch, context, kv_heads, head_dim, block_size, dtype):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 8
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)  # scattered blocks, as after many admissions
    tables = [order[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    meta = AttentionMetadata.build(
        [1] * batch, [context] * batch, tables, block_size, batch, device="cuda"
    )
    k = torch.randn(kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    return meta, k, v


def measure_decode(batch, context, heads, kv_heads, head_dim, dtype):
    """(triton, torch reference, SDPA on pre-gathered tensors) milliseconds."""
    meta, k, v = decode_batch(batch, context, kv_heads, head_dim, 16, dtype)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda")
    scale = head_dim**-0.5
    t_triton = timed(lambda: paged_attention(q, k, v, meta, scale))
    t_torch = timed(lambda: paged_attention_torch(q, k, v, meta, scale), 10)
    nb = -(-context // 16)
    gk = k[:, meta.block_tables[:, :nb]].flatten(2, 3).transpose(0, 1).contiguous()
    gv = v[:, meta.block_tables[:, :nb]].flatten(2, 3).transpose(0, 1).contiguous()
    qs = q.view(batch, heads, 1, head_dim)
    t_sdpa = timed(lambda: F.scaled_dot_product_attention(qs, gk, gv, scale=scale, enable_gqa=True))
    return t_triton, t_torch, t_sdpa


def measure_norm(rows, hidden, dtype):
    """(triton, torch reference) milliseconds for residual add + RMSNorm."""
    x = torch.randn(rows, hidden, dtype=dtype, device="cuda")
    res, w = torch.randn_like(x), torch.ones(hidden, dtype=dtype, device="cuda")
    return (
        timed(lambda: add_rms_norm_triton(x, res, w, 1e-5)),
        timed(lambda: add_rms_norm_torch(x, res, w, 1e-5)),
    )


def measure_rotary(rows, heads, kv_heads, head_dim, dtype):
    """(triton, torch reference) milliseconds for rotary on q and k views of a fused qkv."""
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device="cuda")
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    cos = torch.randn(rows, head_dim, dtype=dtype, device="cuda")
    sin = torch.randn_like(cos)
    return (
        timed(lambda: rotary_triton(q, k, cos, sin)),
        timed(lambda: rotary_torch(q, k, cos, sin)),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--peak-gbs", type=float, default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    peak = args.peak_gbs or next((v for k, v in PEAKS.items() if k in name), None)
    lines = [
        f"device: {name}, dtype {args.dtype}, peak {peak or '?'} GB/s",
        "",
        "| kernel | batch | context | heads q/kv | head_dim | triton ms | torch ms "
        "| sdpa (gathered) ms | triton GB/s | % of peak |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for heads, kv_heads, head_dim in ((32, 8, 128), (9, 3, 64)):
        for batch in (1, 16, 64):
            for context in (512, 4096, 16384):
                if batch * context > 64 * 16384:
                    continue
                t_triton, t_torch, t_sdpa = measure_decode(
                    batch, context, heads, kv_heads, head_dim, dtype
                )
                bytes_read = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
                gbs = bytes_read / (t_triton * 1e-3) / 1e9
                share = f"{100 * gbs / peak:.0f}%" if peak else "?"
                lines.append(
                    f"| decode attention | {batch} | {context} | {heads}/{kv_heads} | "
                    f"{head_dim} | {t_triton:.3f} | {t_torch:.3f} | {t_sdpa:.3f} | "
                    f"{gbs:.0f} | {share} |"
                )
                print(lines[-1], flush=True)
    # Prefill chunks: 4 prompts of 512 new tokens after 1,024 cached.
    heads, kv_heads, head_dim = 32, 8, 128
    tables = [list(range(i * 96, (i + 1) * 96)) for i in range(4)]
    meta = AttentionMetadata.build([512] * 4, [1536] * 4, tables, 16, 0, device="cuda")
    k = torch.randn(kv_heads, 400, 16, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(2048, heads, head_dim, dtype=dtype, device="cuda")
    t_triton = timed(lambda: paged_attention(q, k, v, meta, 0.088), 10)
    t_torch = timed(lambda: paged_attention_torch(q, k, v, meta, 0.088), 10)
    lines.append(
        f"| prefill attention | 4x512 | 1536 | 32/8 | 128 | {t_triton:.3f} | {t_torch:.3f} | | | |"
    )
    kn = torch.randn(2048, kv_heads, head_dim, dtype=dtype, device="cuda")
    t_triton = timed(lambda: write_kv(kn, kn, k, v, meta.slot_mapping))
    t_torch = timed(lambda: write_kv_torch(kn, kn, k, v, meta.slot_mapping))
    lines.append(f"| kv write | 2048 rows | | 8 kv | 128 | {t_triton:.3f} | {t_torch:.3f} | | | |")
    # Residual add + RMSNorm and rotary over a decode batch and a prefill step (Llama-3-8B
    # shapes): memory-bound, so GB/s (reads + writes) is the figure of merit.
    for rows in (64, 4096):
        t_triton, t_torch = measure_norm(rows, 4096, dtype)
        gbs = 4 * rows * 4096 * dtype.itemsize / (t_triton * 1e-3) / 1e9
        share = f"{100 * gbs / peak:.0f}%" if peak else "?"
        lines.append(
            f"| add + rms_norm | {rows} rows | | | 4096 | {t_triton:.3f} | {t_torch:.3f} | "
            f"| {gbs:.0f} | {share} |"
        )
        t_triton, t_torch = measure_rotary(rows, 32, 8, 128, dtype)
        gbs = 2 * rows * 40 * 128 * dtype.itemsize / (t_triton * 1e-3) / 1e9
        share = f"{100 * gbs / peak:.0f}%" if peak else "?"
        lines.append(
            f"| rotary (in place) | {rows} rows | | 32/8 | 128 | {t_triton:.3f} | "
            f"{t_torch:.3f} | | {gbs:.0f} | {share} |"
        )
    print("\n".join(lines[-6:]))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
