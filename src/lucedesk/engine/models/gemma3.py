"""Gemma 3 (text): five sliding-window layers (window 512 in the small models, rotary base
10,000) to one full layer (base 1e6, linearly scaled in the larger models); RMSNorms that
multiply by (1 + w), before and after both attention and the MLP; q/k norm; embeddings
scaled by sqrt(hidden); GELU (tanh) gating; attention scaled by query_pre_attn_scalar.

Gemma files store (1 + w) already (llama.cpp's converter adds the one), so checkpoints
from a Hugging Face folder get it added here."""

from __future__ import annotations

import math
from dataclasses import replace

from lucedesk.engine.models.config import FULL, SLIDING, ModelConfig
from lucedesk.engine.models.family import Family, Weights
from lucedesk.engine.models.gpt_oss import HF_LAYER_TYPES
from lucedesk.errors import ModelLoadError

# Gemma's own turn format (as its instruction-tuned models' template writes it), for files
# that carry no template: a system message is folded into the first user turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] | trim + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{% if message['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
LOCAL_ROPE_THETA = 10000.0
PATTERN = 6  # layer i is full when i % 6 == 5 (llama.cpp's default for Gemma 3 files)


def _pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _gemma(c: ModelConfig) -> ModelConfig:
    return replace(
        c,
        qk_norm=True,
        sandwich_norms=True,
        float32_norms=True,
        embedding_scale=math.sqrt(c.hidden_size),
        hidden_act="gelu_tanh",
    )


def _from_hf(raw: dict, c: ModelConfig) -> ModelConfig:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ModelLoadError(f"config.json: {key} is set; lucedesk runs Gemma 3 without it")
    types = raw.get("layer_types")
    layer_types = (
        tuple(HF_LAYER_TYPES.get(t, t) for t in types)
        if types
        else _pattern(c.num_layers, int(raw.get("sliding_window_pattern") or PATTERN))
    )
    rope = raw.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    full = rope.get("full_attention") or {}
    scaling = c.rope_scaling
    if full:
        scaling = full if full.get("rope_type", "default") != "default" else None
    return replace(
        _gemma(c),
        layer_types=layer_types,
        sliding_window=int(raw.get("sliding_window") or 4096),  # transformers' default
        rope_theta=float(full.get("rope_theta", c.rope_theta)),
        rope_scaling=scaling,
        rope_local_theta=float(
            local.get("rope_theta", raw.get("rope_local_base_freq", LOCAL_ROPE_THETA))
        ),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or c.head_dim),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def _from_gguf(gguf, c: ModelConfig) -> ModelConfig:
    k = "gemma3."
    pattern = gguf.get(k + "attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: true = sliding
        layer_types = tuple(SLIDING if flag else FULL for flag in pattern)
    else:
        layer_types = _pattern(c.num_layers, int(pattern or PATTERN))
    # llama.cpp scales the 27B model's queries by its hidden size per head (its
    # query_pre_attn_scalar), every other Gemma 3 by the head size.
    scalar = c.hidden_size / c.num_heads if c.num_layers == 62 else c.head_dim
    return replace(
        _gemma(c),
        layer_types=layer_types,
        sliding_window=int(gguf.require(k + "attention.sliding_window")),
        rope_local_theta=LOCAL_ROPE_THETA,
        query_pre_attn_scalar=float(scalar),
    )


def _hf_weights(weights: Weights, c: ModelConfig) -> Weights:
    for name in [n for n in weights if n.endswith("norm.weight")]:
        weights[name] = weights[name].float() + 1.0
    return weights


GEMMA3 = Family(
    "gemma3",
    ("gemma3_text",),
    ("gemma3",),
    from_hf=_from_hf,
    from_gguf=_from_gguf,
    hf_weights=_hf_weights,
    gguf_names={
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    chat_template=CHAT_TEMPLATE,
    stop_tokens=("<end_of_turn>",),
)
