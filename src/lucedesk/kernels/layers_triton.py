"""Residual-add + RMSNorm and rotary embedding as Triton kernels (GPUs).

Both are memory-bound elementwise work that torch runs as ~8 (norm) and ~12 (rotary)
separate kernels per layer, each a full pass over the activations; here each is one pass.
Numerics follow layers_torch.py: float32 statistics and products, rounded to the
activation dtype where the reference rounds."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lucedesk.kernels.checks import check_norm_args, check_rotary_args, require


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
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    dtype = x.dtype
    v = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the residual stream, in dtype
        tl.store(res_out_ptr + row * H + cols, s, mask=mask)
        v = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_FP32:  # one rounding, at the end (float32 activations round nothing before)
        y = v * inv * w
    else:
        y = (v * inv).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * H + cols, y.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    num_q_heads,
    HALF: tl.constexpr,
):
    # One program per (row, head) over q's heads then k's: x * cos + rotate_half(x) * sin.
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        base = q_ptr + row * q_stride_t + head * q_stride_h
    else:
        base = k_ptr + row * k_stride_t + (head - num_q_heads) * k_stride_h
    d = tl.arange(0, HALF)
    x1 = tl.load(base + d)
    x2 = tl.load(base + HALF + d)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + row * 2 * HALF + d).to(tl.float32)
    c2 = tl.load(cos_ptr + row * 2 * HALF + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + row * 2 * HALF + d).to(tl.float32)
    s2 = tl.load(sin_ptr + row * 2 * HALF + HALF + d).to(tl.float32)
    a1 = (x1.to(tl.float32) * c1).to(dtype).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dtype).to(tl.float32)
    tl.store(base + d, (a1 + b1).to(dtype))
    tl.store(base + HALF + d, (a2 + b2).to(dtype))


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
            HAS_RESIDUAL=residual is not None,
            WEIGHT_FP32=weight.dtype == torch.float32,
            BLOCK=triton.next_power_of_2(H),
        )
    return out, res_out


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
        _rotary_kernel[(T, nh + k.shape[1])](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), nh, HALF=hd // 2
        )
    return q, k
