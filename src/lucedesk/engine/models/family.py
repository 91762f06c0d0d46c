"""What makes a model family: how its files' settings become a ModelConfig and how their
tensors are named. One `Family` per file under engine/models (llama.py, qwen3_moe.py,
gpt_oss.py, gemma3.py); families.py lists them.

Weights reach the decoder under one set of names (Hugging Face's Llama names, plus a few
of lucedesk's own where families differ), whatever file they came from:

    model.embed_tokens.weight  model.norm.weight  lm_head.weight
    model.layers.{i}.input_layernorm.weight            before attention
    model.layers.{i}.post_attention_layernorm.weight   before the MLP
      (sandwich families: after attention; pre_feedforward_layernorm before the MLP and
       post_feedforward_layernorm after it)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}  self_attn.{q,k}_norm.weight
    model.layers.{i}.self_attn.sinks
    model.layers.{i}.mlp.{gate,up,down}_proj.weight    a dense MLP
    model.layers.{i}.mlp.router.{weight,bias}          a mixture of experts: the router,
    model.layers.{i}.mlp.experts.gate_up  [E, 2I, H]   gate rows first
    model.layers.{i}.mlp.experts.down     [E, H, I]
    model.layers.{i}.mlp.experts.{gate_up,down}_bias
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lucedesk.engine.models.config import ModelConfig

Weights = dict[str, torch.Tensor]


def _same(_source: Any, config: ModelConfig) -> ModelConfig:
    return config


def _same_weights(weights: Weights, _config: ModelConfig) -> Weights:
    return weights


@dataclass(frozen=True)
class Family:
    name: str
    hf_types: tuple[str, ...]  # config.json model_type values
    gguf_archs: tuple[str, ...]  # general.architecture values
    # The shared settings (loader.py, gguf_file.py) refined from config.json's dict...
    from_hf: Callable[[dict, ModelConfig], ModelConfig] = _same
    # ...and from a GGUF file (a GGUFFile: .get/.require on metadata keys, .tensors).
    from_gguf: Callable[[Any, ModelConfig], ModelConfig] = _same
    # A Hugging Face checkpoint's tensors under the shared names (docstring above).
    hf_weights: Callable[[Weights, ModelConfig], Weights] = _same_weights
    # GGUF layer tensor roles whose shared name differs from the Llama mapping.
    gguf_names: dict[str, str] = field(default_factory=dict)
    # llama.cpp's converter interleaves each head's rotary halves of q and k (Llama only).
    permuted_qk: bool = False
    # The chat template when a file has none (Gemma files often do not), and tokens that
    # end a turn beyond the file's end-of-sequence ids.
    chat_template: str | None = None
    stop_tokens: tuple[str, ...] = ()


def stack_experts(
    weights: Weights, prefix: str, num_experts: int, names: tuple[str, str, str]
) -> None:
    """Per-expert tensors `{prefix}{e}.{gate}.weight` (and up, down) -> the shared stacked
    `mlp.experts.gate_up` / `mlp.experts.down`, in place. A missing one is left for the
    weight loader to name."""
    wanted = [f"{prefix}{e}.{n}.weight" for n in names for e in range(num_experts)]
    if any(name not in weights for name in wanted):
        return
    gate, up, down = (
        torch.stack([weights.pop(f"{prefix}{e}.{n}.weight") for e in range(num_experts)])
        for n in names
    )
    base = prefix.removesuffix("experts.")
    weights[base + "experts.gate_up"] = torch.cat([gate, up], dim=1)
    weights[base + "experts.down"] = down
