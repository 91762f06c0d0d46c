"""The grouped matmul of a mixture of experts as one Triton kernel (GPUs): the design of
vLLM's fused MoE, a grouped GEMM over rows sorted by expert.

Each expert's rows are cut into tiles of BLOCK_M rows; one program takes one tile and one
BLOCK_N slice of the outputs, and multiplies the tile by its expert's weight over K. The
tile table is built on the device from the per-expert counts (no host sync), sized for the
most tiles the rows could need; programs past the real count return at once.

    rows (sorted):  | e0 e0 e0 e0 e0 | e2 | e3 e3 |     BLOCK_M = 4
    tiles:            t0: e0 rows 0-3, t1: e0 row 4, t2: e2 row 5, t3: e3 rows 6-7
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lucedesk.kernels.triton_numerics import _dot_dtype, interpreting_bf16, narrow

BLOCK_M = 16  # decode batches give experts a few rows each: small row tiles waste least
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_stop_ptr,
    num_tiles_ptr,
    N,
    K,
    x_stride,
    w_stride_e,
    w_stride_n,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    tile = tl.program_id(0)
    if tile >= tl.load(num_tiles_ptr):
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    row0 = tl.load(tile_row_ptr + tile).to(tl.int64)
    stop = tl.load(tile_stop_ptr + tile).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < stop
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            x_ptr + rows[:, None] * x_stride + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        b = tl.load(
            w_ptr + expert * w_stride_e + cols[:, None] * w_stride_n + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
    tl.store(
        out_ptr + rows[:, None] * out_stride + cols[None, :],
        narrow(acc, out_ptr.dtype.element_ty, EMULATE_BF16),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def tile_table(counts: torch.Tensor, num_rows: int, block_m: int = BLOCK_M):
    """(expert, first row, end row) per tile, the number of tiles as a [1] tensor, and the
    table's length: a bound known on the host (every expert with rows wastes at most one
    partial tile)."""
    counts = counts.to(torch.int64)
    num_experts = counts.shape[0]
    per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(per_expert, 0)
    bound = max(1, -(-num_rows // block_m) + min(num_experts, num_rows))
    t = torch.arange(bound, device=counts.device)
    expert = torch.searchsorted(tile_end, t, right=True).clamp(max=num_experts - 1)
    row_start = torch.cumsum(counts, 0) - counts
    first_tile = tile_end - per_expert
    rows = row_start[expert] + (t - first_tile[expert]) * block_m
    stop = row_start[expert] + counts[expert]
    return expert, rows, stop, tile_end[-1:], bound


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x: [P, K] sorted by expert; weight: [E, N, K]; counts: [E] -> [P, N] (as
    `grouped_linear_torch`)."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not agree")
    if counts.shape != (weight.shape[0],):
        raise ValueError(f"counts must be [{weight.shape[0]}], got {tuple(counts.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}) differ")
    x = x.contiguous()
    weight = weight.contiguous()
    num_rows, k = x.shape
    n = weight.shape[1]
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    expert, rows, stop, num_tiles, bound = tile_table(counts.to(x.device), num_rows)
    _grouped_linear_kernel[(bound, triton.cdiv(n, BLOCK_N))](
        x,
        weight,
        out,
        expert,
        rows,
        stop,
        num_tiles,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        **grouped_constants(x.dtype),
    )
    return out


def grouped_constants(dtype: torch.dtype, interpret: bool | None = None) -> dict:
    """The constexprs of a launch: the tiles, and the dots' dtype (fp32 tiles for bf16 in
    the interpreter) and precision ("ieee": exact fp32, the one every target takes)."""
    return dict(
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee",
        DOT_DTYPE=_dot_dtype(dtype, interpret),
        EMULATE_BF16=interpreting_bf16(dtype, interpret),
    )
