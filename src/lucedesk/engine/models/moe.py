"""The MLPs of a decoder layer: the dense gated MLP, and a mixture of experts where a router
picks `num_experts_per_tok` experts per token and the token's output is the weighted sum of
their gated MLPs.

One pass per layer runs every selected expert of every row: the (token, expert) pairs are
sorted by expert, each expert's rows multiplied by its weights in one grouped matmul
(kernels.grouped_linear, or the C++ low-bit pass for quantized experts), and each token's k
results summed in the order the router ranked them. Nothing a row computes depends on the
other rows, so batching changes no token's result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lucedesk.engine.models.config import ModelConfig
from lucedesk.kernels import Kernels

EXPERT_PROJECTIONS = ("gate_up", "down")


def gated(c: ModelConfig, gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate rows first, then up) -> [T, I] by the family's activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    if c.hidden_act == "silu":
        return F.silu(gate) * up
    if c.hidden_act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    # swiglu_clamped (gpt-oss): both halves clamped, up shifted by one
    gate = gate.clamp(max=c.swiglu_limit)
    up = up.clamp(min=-c.swiglu_limit, max=c.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * c.swiglu_alpha))


class GroupedProjection(Protocol):
    """Experts' weights in another format (low-bit): rows sorted by expert -> outputs."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...


class Experts(nn.Module):
    """`num_experts` gated MLPs. Dense weights (gate_up [E, 2I, H], gate rows first; down
    [E, H, I]) are empty until loaded: a model whose experts are quantized straight from
    its file never holds them densely."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        E, H, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.shapes = {"gate_up": (E, 2 * inter, H), "down": (E, H, inter)}
        self.gate_up = nn.Parameter(torch.empty(0, dtype=dtype))
        self.down = nn.Parameter(torch.empty(0, dtype=dtype))
        self.gate_up_bias = (
            nn.Parameter(torch.zeros(E, 2 * inter, dtype=dtype)) if c.expert_bias else None
        )
        self.down_bias = nn.Parameter(torch.zeros(E, H, dtype=dtype)) if c.expert_bias else None
        self.quantized: dict[str, GroupedProjection] = {}

    @property
    def ready(self) -> bool:
        return all(p in self.quantized or getattr(self, p).numel() > 0 for p in EXPERT_PROJECTIONS)

    def project(
        self, name: str, x: torch.Tensor, counts: torch.Tensor, kernels: Kernels
    ) -> torch.Tensor:
        quantized = self.quantized.get(name)
        if quantized is not None:
            return quantized(x, counts)
        return kernels.grouped_linear(x, getattr(self, name), counts)

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor, kernels: Kernels
    ) -> torch.Tensor:
        """x: [P, H] rows sorted by expert, expert_ids: [P] each row's expert, counts: [E]
        -> [P, H]."""
        h = self.project("gate_up", x, counts, kernels)  # [P, 2I]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[expert_ids]
        y = self.project("down", gated(self.c, h), counts, kernels)  # [P, H]
        if self.down_bias is not None:
            y = y + self.down_bias[expert_ids]
        return y


class MoEBlock(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        self.router = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, dtype=dtype))
        self.router_bias = (
            nn.Parameter(torch.zeros(c.num_experts, dtype=dtype)) if c.expert_bias else None
        )
        self.experts = Experts(c, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k]), best first."""
        c = self.c
        logits = F.linear(x, self.router, self.router_bias)  # [T, E]
        if c.router == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, c.num_experts_per_tok, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(x.dtype), ids
        top, ids = torch.topk(logits, c.num_experts_per_tok, dim=-1)  # topk_softmax
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        T, k = x.shape[0], self.c.num_experts_per_tok
        weights, ids = self.route(x)
        flat = ids.reshape(-1)  # [T*k] pair -> expert, pair p is token p // k
        order = torch.argsort(flat, stable=True)  # pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.c.num_experts)
        rows = x.index_select(0, order // k)  # [P, H]
        y = self.experts(rows, flat[order], counts, kernels)
        pairs = torch.empty_like(y).index_copy_(0, order, y).view(T, k, -1)
        out = pairs[:, 0] * weights[:, :1]
        for j in range(1, k):  # in rank order, whatever else is in the batch
            out = out + pairs[:, j] * weights[:, j : j + 1]
        return out


class DenseMLP(nn.Module):
    """gate|up fused in one matmul, then down."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        H, inter = c.hidden_size, c.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, H, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(H, inter, dtype=dtype))

    def forward(self, x: torch.Tensor, project: Callable[..., torch.Tensor]) -> torch.Tensor:
        return project("down_proj", gated(self.c, project("gate_up_proj", x)))
