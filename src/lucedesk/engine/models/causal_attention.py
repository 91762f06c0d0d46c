"""The model's `Attention` without paged caches (`CausalAttention`)."""

from __future__ import annotations

import torch

from lucedesk.engine.models.config import ModelConfig
from lucedesk.kernels.attention_torch import causal_attention_torch


class CausalAttention:
    """Attention for one whole sequence with no cache: the simple reference path, used to
    check model code against other implementations."""

    def __init__(self, config: ModelConfig) -> None:
        self.scale = config.attention_scale

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return causal_attention_torch(q, k, v, self.scale, window, sinks)

    def cache_rows(self, layer_idx: int, dtype: torch.dtype) -> None:
        return None  # no cache: k and v come with each call

    def stack_inputs(self) -> None:
        return None  # no paged caches
