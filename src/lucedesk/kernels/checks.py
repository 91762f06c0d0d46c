"""Argument checks shared by the kernel wrappers (C++ and Triton): a `ValueError` that says
what is wrong, instead of a crash or a wrong answer inside a kernel."""

from __future__ import annotations

import torch


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_norm_args(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """x, residual: contiguous [T, H], one dtype; weight: contiguous [H], x's dtype or
    float32 (which multiplies before the one rounding)."""
    require(x.dim() == 2 and x.is_contiguous(), f"x must be contiguous [T, H], got {x.shape}")
    require(weight.shape == (x.shape[1],), "weight must be [H]")
    require(
        weight.dtype in (x.dtype, torch.float32) and weight.is_contiguous(),
        "weight: x's dtype or float32, contiguous",
    )
    if residual is not None:
        require(residual.shape == x.shape, "residual must have x's shape")
        require(residual.dtype == x.dtype and residual.is_contiguous(), "residual: x's dtype")


def check_rotary_args(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """q [T, nh, hd] and k [T, kvh, hd] with head_dim dense (views into a fused qkv are
    fine); cos/sin: contiguous [T, hd]; one dtype."""
    for name, t in (("q", q), ("k", k)):
        require(t.dim() == 3 and t.stride(2) == 1, f"{name} must be [T, heads, hd], hd dense")
        require(t.dtype == cos.dtype == sin.dtype, f"{name}, cos and sin must share a dtype")
    require(q.shape[2] == k.shape[2] and q.shape[0] == k.shape[0], "q and k differ in shape")
    require(
        cos.shape == sin.shape == (q.shape[0], q.shape[2]) and cos.is_contiguous(),
        f"cos/sin must be contiguous [T, head_dim], got {tuple(cos.shape)}",
    )
    require(sin.is_contiguous(), "sin must be contiguous")
