"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with q/k/v/o biases and a learned sink
logit per head, sliding-window and full layers alternating (window 128, the first layer
sliding), YaRN rotary on every layer; a mixture of experts whose router takes the top k
logits and a softmax over them, experts with biases and a clamped SwiGLU
((up + 1) * gate * sigmoid(1.702 gate), |x| <= 7). Its files keep the experts in MXFP4.

The harmony chat format it speaks is harmony.py."""

from __future__ import annotations

from dataclasses import replace

import torch

from lucedesk.engine.models.config import FULL, SLIDING, ModelConfig
from lucedesk.engine.models.family import Family, Weights
from lucedesk.errors import ModelLoadError

HF_LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": FULL}


def _moe(c: ModelConfig, experts: int, per_token: int, ffn: int) -> ModelConfig:
    return replace(
        c,
        attention_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        float32_norms=True,
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=ffn,
        router="topk_softmax",
        expert_bias=True,
        hidden_act="swiglu_clamped",
    )


def _from_hf(raw: dict, c: ModelConfig) -> ModelConfig:
    types = raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c.num_layers)
    ]
    c = _moe(
        c,
        int(raw["num_local_experts"]),
        int(raw["num_experts_per_tok"]),
        int(raw["intermediate_size"]),
    )
    return replace(
        c,
        layer_types=tuple(HF_LAYER_TYPES.get(t, t) for t in types),
        sliding_window=int(raw.get("sliding_window") or 128),  # transformers' default
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
    )


def _from_gguf(gguf, c: ModelConfig) -> ModelConfig:
    k = "gpt-oss."
    c = _moe(
        c,
        int(gguf.require(k + "expert_count")),
        int(gguf.require(k + "expert_used_count")),
        int(gguf.get(k + "expert_feed_forward_length") or c.intermediate_size),
    )
    scaling = c.rope_scaling
    if gguf.get(k + "rope.scaling.type") == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": float(gguf.require(k + "rope.scaling.factor")),
            "original_max_position_embeddings": int(
                gguf.require(k + "rope.scaling.original_context_length")
            ),
            "beta_fast": float(gguf.get(k + "rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(gguf.get(k + "rope.scaling.yarn_beta_slow") or 1.0),
            "truncate": False,
        }
    return replace(
        c,
        rope_scaling=scaling,
        # llama.cpp: the even layers slide, the odd ones see everything
        layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(c.num_layers)),
        sliding_window=int(gguf.require(k + "attention.sliding_window")),
    )


def _hf_weights(weights: Weights, c: ModelConfig) -> Weights:
    """transformers keeps experts as x @ W ([E, H, 2I], gate and up interleaved by
    column): turned into the shared [E, 2I, H] with the gate rows first."""
    if any(name.endswith("_proj_blocks") for name in weights):
        raise ModelLoadError(
            "gpt-oss experts in MXFP4 blocks (the checkpoint as OpenAI publishes it) are read "
            "from its GGUF file, not from a Hugging Face folder: load the .gguf"
        )
    for i in range(c.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" in weights:
            w = weights.pop(p + "gate_up_proj")  # [E, H, 2I]
            weights[p + "gate_up"] = torch.cat([w[..., 0::2], w[..., 1::2]], -1).transpose(1, 2)
        if p + "gate_up_proj_bias" in weights:
            b = weights.pop(p + "gate_up_proj_bias")  # [E, 2I]
            weights[p + "gate_up_bias"] = torch.cat([b[:, 0::2], b[:, 1::2]], -1)
        if p + "down_proj" in weights:
            weights[p + "down"] = weights.pop(p + "down_proj").transpose(1, 2)  # [E, H, I]
        if p + "down_proj_bias" in weights:
            weights[p + "down_bias"] = weights.pop(p + "down_proj_bias")
    return weights


GPT_OSS = Family(
    "gpt-oss",
    ("gpt_oss",),
    ("gpt-oss",),
    from_hf=_from_hf,
    from_gguf=_from_gguf,
    hf_weights=_hf_weights,
    # The pre-MLP norm is post_attention_norm in its files (the Llama name's GGUF twin).
    gguf_names={"post_attention_norm": "post_attention_layernorm"},
)
