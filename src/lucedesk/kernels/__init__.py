"""Kernels for one decoder step: paged attention and KV writes, residual-add + RMSNorm,
rotary embedding and the greedy choice, in three implementations picked by name:

- `torch`: plain torch ops, runs anywhere; the reference the others are tested against.
- `cpu`: C++ kernels built on first use (`cpu_build.py`, wrapped in `cpu.py`): attention
  over KV blocks in place, fused norms and rotary, greedy choices, for CPUs.
- `triton`: Triton kernels for GPUs (CUDA, and ROCm unchanged).

`get_kernels(name)` is the one place the runner and the model pick an implementation."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lucedesk.errors import ConfigError

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "torch", "cpu", "triton")


class Kernels(NamedTuple):
    name: str
    # (k, v, k_cache, v_cache, slot_mapping, k_scale=, v_scale=): scales for an int8 cache
    write_kv: Callable[..., None]
    # (q, k_cache, v_cache, meta, scale, window, sinks, k_scale=, v_scale=) -> out
    attention: Callable[..., torch.Tensor]
    # (x, residual | None, weight, eps) -> (rms_norm(x + residual) * weight, x + residual)
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (q, k, cos, sin) -> (q, k) rotated; may rotate in place
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (x [P, K] sorted by expert, weight [E, N, K], counts [E]) -> [P, N]: experts' matmuls
    grouped_linear: Callable[..., torch.Tensor]
    # (logits [R, vocab] float32) -> [R] int64: torch.argmax(dim=-1)'s choice, the greedy one
    greedy: Callable[[torch.Tensor], torch.Tensor]
    # A dense layer's halves around attention as one call each (cpu.FusedLayerCalls), or None
    fused: Any = None
    # A model's layers as one call a step (cpu_stack.LayerStack), or None
    stack: type | None = None


def resolve_kernels(name: str, device: torch.device) -> str:
    """`auto` means Triton on a GPU; on a CPU the C++ kernels where they build, else torch."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton"
    from lucedesk.kernels.cpu_build import KernelUnavailable, load_cpu_ops

    try:
        load_cpu_ops()
    except KernelUnavailable as exc:
        log.warning("CPU kernels unavailable, using torch ops: %s", exc)
        return "torch"
    return "cpu"


def get_kernels(name: str) -> Kernels:
    from lucedesk.kernels.attention_torch import paged_attention_torch, write_kv_torch
    from lucedesk.kernels.layers_torch import add_rms_norm_torch, greedy_torch, rotary_torch
    from lucedesk.kernels.moe_torch import grouped_linear_torch

    if name == "torch":
        return Kernels(
            "torch",
            write_kv_torch,
            paged_attention_torch,
            add_rms_norm_torch,
            rotary_torch,
            grouped_linear_torch,
            greedy_torch,
        )
    if name == "cpu":
        from lucedesk.kernels.cpu import (
            FusedLayerCalls,
            add_rms_norm_cpu,
            greedy_cpu,
            paged_attention_cpu,
            rotary_cpu,
            write_kv_cpu,
        )
        from lucedesk.kernels.cpu_build import KernelUnavailable, load_cpu_ops
        from lucedesk.kernels.cpu_stack import LayerStack

        try:
            load_cpu_ops()
        except KernelUnavailable as exc:
            raise ConfigError(f"kernels 'cpu': {exc}") from None
        # Experts in the model dtype multiply through torch; low-bit experts bring their own
        # grouped C++ pass (kernels/quantized.py).
        return Kernels(
            "cpu",
            write_kv_cpu,
            paged_attention_cpu,
            add_rms_norm_cpu,
            rotary_cpu,
            grouped_linear_torch,
            greedy_cpu,
            FusedLayerCalls(),
            LayerStack,
        )
    if name == "triton":
        try:
            from lucedesk.kernels.attention_triton import paged_attention
            from lucedesk.kernels.kv_write_triton import write_kv
            from lucedesk.kernels.layers_triton import add_rms_norm_triton, rotary_triton
            from lucedesk.kernels.moe_triton import grouped_linear
        except ImportError as exc:
            raise ConfigError(f"kernels 'triton' need the triton package ({exc})") from None
        return Kernels(
            "triton",
            write_kv,
            paged_attention,
            add_rms_norm_triton,
            rotary_triton,
            grouped_linear,
            greedy_torch,
        )
    raise ConfigError(f"unknown kernels {name!r} (one of {', '.join(KERNEL_CHOICES)})")
