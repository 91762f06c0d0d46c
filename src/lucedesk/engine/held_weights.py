"""A model's matmul weights put in the form the held-format rule chooses
(catalog/held_formats.py, the rule the fit estimates by): the rule asked with what it goes
by here (the kernels, the model dtype, the file's MLP type, the C++ kernels' fast paths on
this CPU), then the format's module (engine/formats/) makes the weights; or, in the model
dtype, the weights still in their file read densely."""

from __future__ import annotations

import logging
import time

import torch

from lucedesk.catalog.held_formats import HeldFormat, choose
from lucedesk.engine.formats import module_of
from lucedesk.engine.models.decoder import DecoderModel
from lucedesk.engine.models.expert_weights import materialize_dense
from lucedesk.errors import ConfigError

log = logging.getLogger("lucedesk.engine.build")


def cpu_paths() -> frozenset[str]:
    """The C++ kernels' fast paths as built here: "vnni", "amx"."""
    from lucedesk.kernels.quantized import int8_tiles_available, lowbit_vector_available

    vnni, amx = lowbit_vector_available(), int8_tiles_available()
    return frozenset(p for p, have in (("vnni", vnni), ("amx", amx)) if have)


def mlp_type(model: DecoderModel) -> str:
    """The GGUF type of the first layer's gate weights (its experts' in a mixture), as the
    fit reads it off the file's header (ModelSummary.mlp_type); "" for a model that is not
    from a GGUF file."""
    if model.layers[0].moe is not None and model.expert_source is not None:
        return model.expert_source.type_name(0, "gate_up")
    source = model.block_source
    return "" if source is None else source(0, "gate_up_proj").types[0]


def shapes(model: DecoderModel) -> list[tuple[int, ...]]:
    """Every matmul weight's shape: the projections, the LM head, the experts' [E, N, K]."""
    c = model.config
    found = [s for layer in model.layers for s in layer.shapes.values()]
    experts = [moe.experts.shapes[p] for _, moe in model.moe_blocks() for p in ("gate_up", "down")]
    return [*found, (c.vocab_size, c.hidden_size), *experts]


def choose_format(model: DecoderModel, wanted: str, kernels: str) -> HeldFormat | None:
    """The format `wanted` means for this model on these kernels (None: the model dtype)."""
    from lucedesk.engine.memory import dtype_name

    if wanted == "auto" and model.weight_format != "dtype":
        wanted = model.weight_format  # already chosen (an engine rebuilt on the same weights)
    paths = cpu_paths() if kernels == "cpu" else frozenset()
    held = choose(wanted, kernels, dtype_name(model.dtype), mlp_type(model), paths)
    odd = [] if held is None else [s for s in shapes(model) if not held.fits(s)]
    if odd and wanted == "auto":
        return None
    if odd:
        raise ConfigError(
            f"weights {wanted!r} need matmul inputs in multiples of 32 and outputs of "
            f"{held.channels} (this model has {odd[0]})"
        )
    return held


def apply_weight_format(model: DecoderModel, wanted: str, kernels: str) -> str:
    """Puts the matmul weights in the form `wanted` means here; returns its name."""
    held = choose_format(model, wanted, kernels)
    name = held.name if held is not None else "dtype"
    if name == model.weight_format:
        if name == "dtype":
            materialize(model)  # weights left in the file until now
        return name
    if model.weight_format != "dtype":
        raise ConfigError(
            f"the loaded model's weights are {model.weight_format}; load it again for {name!r}"
        )
    if held is None:
        materialize(model)
        return name
    module = module_of(held)
    started = time.perf_counter()
    if held.embedding:
        module.hold_embedding(model, held)
    model.quantize(held.name, module.projection_maker(model, held))
    if model.moe_blocks():
        module.hold_experts(model, held)
    log.info("weights held as %s (%s) in %.1f s", held.name, held.description,
             time.perf_counter() - started)  # fmt: skip
    return held.name


def materialize(model: DecoderModel) -> None:
    """Every weight still in its file (a lazy load's projections, LM head and embedding,
    a mixture's experts) read densely into the model dtype, one tensor at a time."""
    source, device = model.block_source, model.norm.device
    if source is None:
        return

    def read(param: torch.Tensor, layer: int | None, proj: str) -> None:
        if param.numel() == 0:
            param.data = source(layer, proj).values().to(model.dtype).to(device)

    read(model.embed_tokens, None, "embed_tokens")
    for i, layer in enumerate(model.layers):
        for proj, param in layer.projections().items():
            read(param, i, proj)
    if model.lm_head is not model.embed_tokens:
        read(model.lm_head, None, "lm_head")
    if model.expert_source is not None:
        materialize_dense(model)


def describe(model: DecoderModel) -> str:
    """How the matmul weights are held, counted by kind: "q4: 61 as blocks (30 Q4_K, 31
    Q6_K), experts 96 (64 Q4_K, 32 Q6_K), embedding Q4_K"; "dtype (bfloat16)"."""
    if model.weight_format == "dtype":
        return f"dtype ({str(model.dtype).removeprefix('torch.')})"
    dense: dict[str, int] = {}
    experts: dict[str, int] = {}
    for layer in model.layers:
        for weight in layer.quantized.values():
            _kinds(weight, dense)
        if layer.moe is not None:
            for weight in layer.moe.experts.quantized.values():
                _kinds(weight, experts)
    head = model.lm_head_quantized
    if head is not None and head is not model.embedding_held:  # a tied head: the embedding
        _kinds(head, dense)

    def said(counts: dict[str, int]) -> str:
        return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))

    text = f"{model.weight_format}: {sum(dense.values())} weights ({said(dense)})"
    if experts:
        text += f", experts' {sum(experts.values())} ({said(experts)})"
    if model.embedding_held is not None:
        text += f", the embedding ({said(_kinds(model.embedding_held, {}))})"
    return text


def _kinds(weight, counts: dict[str, int]) -> dict[str, int]:
    """A held weight's kind: its blocks' GGUF types (a GPU's runs), its bit width (the C++
    kernels' levels, with the level table's name), or int8."""
    runs = getattr(weight, "runs", None)
    if runs is not None:
        kinds = [r.kind for r in runs]
    elif hasattr(weight, "bits"):
        kinds = [f"{weight.bits}-bit" + (" table" if weight.lut is not None else "")]
    else:
        kinds = ["int8"]
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return counts
