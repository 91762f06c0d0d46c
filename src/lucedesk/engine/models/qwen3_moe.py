"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): Qwen3's attention (q/k norm) with
a mixture of experts in every layer but the ones `mlp_only_layers` names: softmax over all
experts, the top k renormalized (`norm_topk_prob`), SiLU-gated experts, no shared expert."""

from __future__ import annotations

from dataclasses import replace

from lucedesk.engine.models.config import ModelConfig
from lucedesk.engine.models.family import Family, Weights, stack_experts


def _from_hf(raw: dict, c: ModelConfig) -> ModelConfig:
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step") or 1)
    mlp_only = set(raw.get("mlp_only_layers") or ())
    dense = tuple(
        i for i in range(c.num_layers) if i in mlp_only or experts == 0 or (i + 1) % step != 0
    )
    return replace(
        c,
        qk_norm=True,
        num_experts=experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),  # transformers' default
        dense_layers=dense,
        router="softmax_topk",
    )


def _from_gguf(gguf, c: ModelConfig) -> ModelConfig:
    k = "qwen3moe."
    return replace(
        c,
        qk_norm=True,
        num_experts=int(gguf.require(k + "expert_count")),
        num_experts_per_tok=int(gguf.require(k + "expert_used_count")),
        moe_intermediate_size=int(gguf.require(k + "expert_feed_forward_length")),
        # llama.cpp always renormalizes Qwen3-MoE's top-k weights.
        norm_topk_prob=bool(gguf.get(k + "expert_weights_norm", True)),
        router="softmax_topk",
    )


def _hf_weights(weights: Weights, c: ModelConfig) -> Weights:
    for i in range(c.num_layers):
        if not c.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp."
        stack_experts(weights, p + "experts.", c.num_experts, ("gate_proj", "up_proj", "down_proj"))
        if p + "gate.weight" in weights:
            weights[p + "router.weight"] = weights.pop(p + "gate.weight")
    return weights


QWEN3_MOE = Family(
    "qwen3moe",
    ("qwen3_moe",),
    ("qwen3moe",),
    from_hf=_from_hf,
    from_gguf=_from_gguf,
    hf_weights=_hf_weights,
)
