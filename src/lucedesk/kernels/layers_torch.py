"""RMSNorm (with the residual add), rotary embedding and the greedy choice in plain torch:
the CPU fallback and the reference the C++ and Triton kernels are tested against.

Statistics are float32 whatever the activation dtype, and results are rounded to the
activation dtype where the reference models round (after the normalisation, after each
product of the rotary), so every implementation can be held to the same numbers."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A float32 `weight` on lower-precision activations multiplies before the one rounding
    (Gemma 3's and gpt-oss's norms); otherwise the normalized row is rounded first (Llama's)."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual) * weight, x + residual); without a
    residual (the first layer) the stream starts at x."""
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, nh, hd], k: [T, kvh, hd], cos/sin: [T, hd] -> rotated (q, k)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def greedy_torch(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, vocab] -> [R] int64: each row's first maximum, a NaN above any number."""
    return logits.argmax(dim=-1)
