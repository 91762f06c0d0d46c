"""The MLPs of a decoder layer: the dense gated MLP, and a mixture of experts where a router
picks `num_experts_per_tok` experts per token and the token's output is the weighted sum of
their gated MLPs.

One pass per layer runs every selected expert of every row: the (token, expert) pairs are
grouped by expert, each expert's rows multiplied by its weights in one grouped matmul
(kernels.grouped_linear over the pairs sorted here, or the C++ low-bit pass, which groups
them itself), and each token's k results summed in the order the router ranked them.
Nothing a row computes depends on the other rows, so batching changes no token's result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

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
    """Experts' weights in another format (low-bit, kernels.quantized.GroupedLowBitWeight):
    pair p is x's row rows[p] (row p without rows) times expert experts[p]'s weight."""

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor: ...


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

    def forward(self, x: torch.Tensor, ids: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """x: [T, H], ids: [T, k] each token's experts -> [T, k, H], each pair's output."""
        T, k = ids.shape
        H = self.c.hidden_size
        flat = ids.reshape(-1)  # pair p is token p // k and expert flat[p]
        if self.quantized and getattr(self.quantized["gate_up"], "SORTED_PAIRS", False):
            return self._sorted_pairs(x, flat, k)
        if self.quantized:  # the C++ pass (CPU tensors) groups the pairs itself
            tokens = torch.arange(T, device=x.device).repeat_interleave(k)
            h = self.quantized["gate_up"](x, flat, tokens)  # [P, 2I]
            h = self._bias(h, self.gate_up_bias, flat)
            y = self.quantized["down"](gated(self.c, h), flat)  # [P, H]
            return self._bias(y, self.down_bias, flat).view(T, k, H)
        # Dense weights: the pairs sorted by expert for one grouped matmul each, and back.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.c.num_experts)
        chosen = flat[order]
        h = kernels.grouped_linear(x.index_select(0, order // k), self.gate_up, counts)
        h = self._bias(h, self.gate_up_bias, chosen)
        y = kernels.grouped_linear(gated(self.c, h), self.down, counts)
        y = self._bias(y, self.down_bias, chosen)
        return torch.empty_like(y).index_copy_(0, order, y).view(T, k, H)

    def _sorted_pairs(self, x: torch.Tensor, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Held weights that take the pairs sorted by expert (a GPU's blocks): gate|up and
        its activation in one grouped pass (with the gate|up bias), then down (with its)."""
        T, H = x.shape[0], self.c.hidden_size
        gate_up, down = self.quantized["gate_up"], self.quantized["down"]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.c.num_experts)
        xs = x.index_select(0, order // k)
        h = gate_up.gated(xs, counts, self.c, self.gate_up_bias)
        if h is None:  # gate and up held apart (their types differ)
            h = gated(self.c, gate_up(xs, counts, self.gate_up_bias))
        y = down(h, counts, self.down_bias)
        return torch.empty_like(y).index_copy_(0, order, y).view(T, k, H)

    @staticmethod
    def _bias(h: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor) -> torch.Tensor:
        # index_select: advanced indexing runs an iterator and a parallel region for a few rows
        return h if bias is None else h + bias.index_select(0, experts)


class MoEBlock(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        # The kernels' one-call mixture (cpu.FusedLayerCalls.moe_mlp) where it takes the
        # experts' weights: the arithmetic of `forward` below, without its ~25 calls.
        self.fused: Any = None
        # The router is tiny (experts x hidden) and runs in float32: a small matmul in bf16
        # costs more than the whole float32 one.
        self.router = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.router_bias = nn.Parameter(torch.zeros(c.num_experts)) if c.expert_bias else None
        self.experts = Experts(c, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k]), best first."""
        c = self.c
        logits = F.linear(x.float(), self.router, self.router_bias)  # [T, E]
        if self.softmax_first():
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, c.num_experts_per_tok, dim=-1)
            return weights.to(x.dtype), ids
        # The top k of a softmax renormalized over them is the softmax of the top k logits.
        top, ids = torch.topk(logits, c.num_experts_per_tok, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), ids

    def softmax_first(self) -> bool:
        """Whether the router's softmax runs over every expert before the top k (else over
        the top k logits)."""
        return self.c.router == "softmax_topk" and not self.c.norm_topk_prob

    def kernel_args(self) -> tuple:
        """What the kernels' one-call mixture takes (cpu.FusedLayerCalls.moe_mlp, the layer
        stack's add_experts): router, gate|up, down, biases, top k, softmax_first, clamp."""
        c, experts = self.c, self.experts
        biases = (self.router_bias, experts.gate_up_bias, experts.down_bias)
        return (
            self.router, experts.quantized.get("gate_up"), experts.quantized.get("down"),
            biases, c.num_experts_per_tok, self.softmax_first(), c.swiglu_limit, c.swiglu_alpha,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        if self.fused is not None:
            return self.fused.moe_mlp(x, self.c.hidden_act, *self.kernel_args())
        weights, ids = self.route(x)
        pairs = self.experts(x, ids, kernels)  # [T, k, H]
        out = pairs[:, 0] * weights[:, :1]
        for j in range(1, ids.shape[1]):  # in rank order, whatever else is in the batch
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

    def forward(
        self, x: torch.Tensor, project: Callable[..., torch.Tensor], gate_up: Any = None
    ) -> torch.Tensor:
        """`gate_up`: the held gate|up weight, which may make act(gate) * up in one pass
        (a GPU's blocks: `gated`, None where it cannot)."""
        fused = getattr(gate_up, "gated", None)
        h = fused(x, self.c) if fused is not None else None
        if h is None:
            h = gated(self.c, project("gate_up_proj", x))
        return project("down_proj", h)
