"""Copying a checkpoint's tensors (under family.py's shared names) into a DecoderModel:
q|k|v and gate|up fused, the family's norms in their places, experts stacked."""

from __future__ import annotations

import torch

from lucedesk.engine.models.decoder import DecoderModel
from lucedesk.errors import ModelLoadError


def load_weights(
    model: DecoderModel, weights: dict[str, torch.Tensor], source: str, lazy: bool = False
) -> None:
    """Copy the tensors into the model's fused layout, converting dtype. A mixture's expert
    weights may be absent (left in their file, see expert_weights.py), and with `lazy` the
    matmul weights and the embedding table (their parameters are emptied: the engine reads
    them from the file, engine/held_weights.py); every other tensor must be there: a
    ModelLoadError names the first one missing or misshapen."""
    c = model.config
    if lazy:
        first = "model.layers.0.self_attn.q_proj.weight"
        matmuls = [p for layer in model.layers for p in layer.projections().values()]
        head = [] if model.lm_head is model.embed_tokens else [model.lm_head]  # a tied head
        if first not in weights:
            for param in [*matmuls, *head]:
                param.data = torch.empty(0, dtype=param.dtype)
        if "model.embed_tokens.weight" not in weights:
            model.embed_tokens.data = torch.empty(0, dtype=model.dtype)

    def take(name: str) -> torch.Tensor:
        try:
            return weights.pop(name)
        except KeyError:
            raise ModelLoadError(f"{source}: missing tensor {name!r}") from None

    def put(param: torch.Tensor, value: torch.Tensor, name: str, shape=None) -> None:
        shape = tuple(param.shape) if shape is None else shape
        if tuple(shape) != tuple(value.shape):
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(value.shape)}, expected {shape}"
            )
        if param.numel() == 0 and value.numel():  # an expert parameter, empty until now
            param.data = value.to(param.dtype).contiguous()
        else:
            param.data.copy_(value.to(param.dtype))

    def load(param: torch.Tensor, name: str, shape=None) -> None:
        put(param, take(name), name, shape)

    if model.embed_tokens.numel():
        load(model.embed_tokens, "model.embed_tokens.weight")
    load(model.norm, "model.norm.weight")
    if not c.tie_word_embeddings and model.lm_head.numel():
        load(model.lm_head, "lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load(layer.attn_norm, p + "input_layernorm.weight")
        if c.sandwich_norms:
            load(layer.attn_out_norm, p + "post_attention_layernorm.weight")
            load(layer.ffn_norm, p + "pre_feedforward_layernorm.weight")
            load(layer.ffn_out_norm, p + "post_feedforward_layernorm.weight")
        else:
            load(layer.ffn_norm, p + "post_attention_layernorm.weight")
        if layer.qkv_proj.numel():
            qkv = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            put(layer.qkv_proj, torch.cat(qkv, 0), p + "self_attn.qkv_proj.weight")
        if c.attention_bias:
            bias = [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            put(layer.qkv_bias, torch.cat(bias, 0), p + "self_attn.qkv_proj.bias")
        if layer.o_proj.numel():
            load(layer.o_proj, p + "self_attn.o_proj.weight")
        if c.o_proj_bias:
            load(layer.o_bias, p + "self_attn.o_proj.bias")
        if c.qk_norm:
            load(layer.q_norm, p + "self_attn.q_norm.weight")
            load(layer.k_norm, p + "self_attn.k_norm.weight")
        if c.attention_sinks:
            load(layer.sinks, p + "self_attn.sinks")
        if layer.moe is None:
            if layer.mlp.gate_up_proj.numel():
                gate_up = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
                put(layer.mlp.gate_up_proj, torch.cat(gate_up, 0), p + "mlp.gate_up_proj.weight")
                load(layer.mlp.down_proj, p + "mlp.down_proj.weight")
            continue
        moe, experts = layer.moe, layer.moe.experts
        load(moe.router, p + "mlp.router.weight")
        if c.expert_bias:
            load(moe.router_bias, p + "mlp.router.bias")
            load(experts.gate_up_bias, p + "mlp.experts.gate_up_bias")
            load(experts.down_bias, p + "mlp.experts.down_bias")
        for proj in ("gate_up", "down"):
            name = p + "mlp.experts." + proj
            if name in weights or model.expert_source is None:
                load(getattr(experts, proj), name, experts.shapes[proj])


def check_file_shapes(model: DecoderModel, gguf, source: str) -> None:
    """The matmul weights a GGUF file keeps until their form is chosen (its projections,
    LM head, embedding table and experts), each of the shape the model has for it, from
    the file's tensor table: a ModelLoadError names the first that is not, as loading it
    densely would."""
    from lucedesk.engine.models.moe import EXPERT_PROJECTIONS

    c = model.config
    names = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
             "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}  # fmt: skip

    def check(name: str, parts, shape: tuple[int, ...]) -> None:
        lead = tuple(parts[0].shape[:-2])  # a mixture's experts
        found = (*lead, sum(t.shape[-2] for t in parts), parts[0].shape[-1])
        if any(t.shape[-1] != found[-1] or tuple(t.shape[:-2]) != lead for t in parts):
            found = tuple(parts[0].shape)
        if found != tuple(shape):
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {found}, expected {shape}")

    head = (c.vocab_size, c.hidden_size)
    check("model.embed_tokens.weight", gguf.projection_tensors(None, "embed_tokens"), head)
    check("lm_head.weight", gguf.projection_tensors(None, "lm_head"), head)
    for i, layer in enumerate(model.layers):
        for proj, shape in layer.shapes.items():
            parts = gguf.projection_tensors(i, proj)
            check(f"model.layers.{i}.{names[proj]}.weight", parts, shape)
        if layer.moe is not None:
            for proj in EXPERT_PROJECTIONS:
                parts = gguf.expert_tensors(i, proj)
                shape = layer.moe.experts.shapes[proj]
                check(f"model.layers.{i}.mlp.experts.{proj}", parts, shape)
