"""Attention and KV-write kernels: Triton for GPUs, torch for the CPU and as the reference.

`get_attention_backend(name)` is the one place the runner picks an implementation."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from lucedesk.errors import ConfigError


class AttentionBackend(NamedTuple):
    name: str
    write_kv: Callable[..., None]  # (k, v, k_cache, v_cache, slot_mapping)
    attention: Callable[..., torch.Tensor]  # (q, k_cache, v_cache, meta, scale) -> out


def resolve_attention(name: str, device: torch.device) -> str:
    """`auto` means Triton on a GPU and torch on the CPU."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from lucedesk.kernels.attention_torch import paged_attention_torch, write_kv_torch

        return AttentionBackend("torch", write_kv_torch, paged_attention_torch)
    if name == "triton":
        try:
            from lucedesk.kernels.attention_triton import paged_attention, write_kv
        except ImportError as exc:
            raise ConfigError(f"attention 'triton' needs the triton package ({exc})") from None
        return AttentionBackend("triton", write_kv, paged_attention)
    raise ConfigError(f"unknown attention implementation {name!r} (torch, triton or auto)")
