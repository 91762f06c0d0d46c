"""Residual-add + RMSNorm and rotary embedding as Triton kernels (GPUs).

Both are memory-bound elementwise work that torch runs as ~8 (norm) and ~12 (rotary)
separate kernels per layer, each a full pass over the activations; here each is one pass.
Numerics follow layers_torch.py: float32 statistics and products, rounded to the
activation dtype where the reference rounds (to nearest, in the interpreter too: `narrow`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lucedesk.kernels.checks import check_norm_args, check_rotary_args, require
from lucedesk.kernels.triton_numerics import interpreting_bf16, narrow


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    weight_ptr,
    out_ptr,
    res_out_ptr,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    dtype = x.dtype
    v = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0)
        s = narrow(x.to(tl.float32) + r.to(tl.float32), dtype, EMULATE_BF16)  # the residual
        tl.store(res_out_ptr + row * H + cols, s, mask=mask)
        v = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_FP32:  # one rounding, at the end (float32 activations round nothing before)
        y = v * inv * w
    else:
        y = narrow(v * inv, dtype, EMULATE_BF16).to(tl.float32) * w
    tl.store(out_ptr + row * H + cols, narrow(y, dtype, EMULATE_BF16), mask=mask)


@triton.jit
def _rotate(
    base, stride_h, cos_ptr, sin_ptr, row, heads,
    PAD: tl.constexpr, HALF: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """One row's `heads` heads (PAD of them, the rest masked), in place: x * cos +
    rotate_half(x) * sin, each product rounded to the dtype as the reference rounds it."""
    h = tl.arange(0, PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    live = h < heads
    x1 = tl.load(base + h * stride_h + d, mask=live, other=0.0)
    x2 = tl.load(base + h * stride_h + HALF + d, mask=live, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + row * 2 * HALF + d).to(tl.float32)
    c2 = tl.load(cos_ptr + row * 2 * HALF + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + row * 2 * HALF + d).to(tl.float32)
    s2 = tl.load(sin_ptr + row * 2 * HALF + HALF + d).to(tl.float32)
    a1 = narrow(x1.to(tl.float32) * c1, dtype, EMULATE_BF16).to(tl.float32)
    b1 = narrow(-x2.to(tl.float32) * s1, dtype, EMULATE_BF16).to(tl.float32)
    a2 = narrow(x2.to(tl.float32) * c2, dtype, EMULATE_BF16).to(tl.float32)
    b2 = narrow(x1.to(tl.float32) * s2, dtype, EMULATE_BF16).to(tl.float32)
    tl.store(base + h * stride_h + d, narrow(a1 + b1, dtype, EMULATE_BF16), mask=live)
    tl.store(base + h * stride_h + HALF + d, narrow(a2 + b2, dtype, EMULATE_BF16), mask=live)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
    num_q_heads, num_kv_heads,
    Q_PAD: tl.constexpr, K_PAD: tl.constexpr, HALF: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    # One program per row: all of q's heads, then all of k's.
    row = tl.program_id(0).to(tl.int64)
    q_row = q_ptr + row * q_stride_t
    _rotate(q_row, q_stride_h, cos_ptr, sin_ptr, row, num_q_heads, Q_PAD, HALF, EMULATE_BF16)
    k_row = k_ptr + row * k_stride_t
    _rotate(k_row, k_stride_h, cos_ptr, sin_ptr, row, num_kv_heads, K_PAD, HALF, EMULATE_BF16)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual) * weight, x + residual)."""
    check_norm_args(x, residual, weight)
    T, H = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if T:
        _add_rms_norm_kernel[(T,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out,
            H,
            eps,
            **norm_constants(residual is not None, weight.dtype == torch.float32, H, x.dtype),
        )
    return out, res_out


def norm_constants(
    residual: bool, weight_fp32: bool, hidden: int, dtype: torch.dtype, interpret=None
) -> dict:
    """One program a row over all of it: more warps for wider rows (four spilled registers
    on the AMD targets at 8,192)."""
    block = triton.next_power_of_2(hidden)
    return dict(
        HAS_RESIDUAL=residual,
        WEIGHT_FP32=weight_fp32,
        BLOCK=block,
        EMULATE_BF16=interpreting_bf16(dtype, interpret),
        num_warps=min(16, max(4, block // 512)),
    )


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, nh, hd] and k [T, kvh, hd] in place (views into a fused qkv are fine);
    cos/sin: [T, hd], each row's table entry."""
    check_rotary_args(q, k, cos, sin)
    hd = q.shape[2]
    require(hd % 2 == 0 and hd & (hd - 1) == 0, f"head_dim must be a power of two, got {hd}")
    T, nh = q.shape[0], q.shape[1]
    if T:
        _rotary_kernel[(T,)](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), nh, k.shape[1],
            **rotary_constants(nh, k.shape[1], hd, q.dtype),
        )  # fmt: skip
    return q, k


def rotary_constants(
    q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, interpret=None
) -> dict:
    """One program a row, all its heads: eight warps from 64 heads of 256 (four spilled)."""
    q_pad = triton.next_power_of_2(q_heads)
    return dict(
        Q_PAD=q_pad,
        K_PAD=triton.next_power_of_2(kv_heads),
        HALF=head_dim // 2,
        EMULATE_BF16=interpreting_bf16(dtype, interpret),
        num_warps=4 if q_pad * head_dim < 16384 else 8,
    )
