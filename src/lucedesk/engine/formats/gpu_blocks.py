"""GGUF blocks held on a GPU (q4 and int8 on the Triton kernels, kernels/block_weights.py):
each weight as its file's blocks reordered into planes (kernels/blocks.py), consecutive
parts of one type in one run; a part in a type the format does not take (a float weight;
for int8 any but Q8_0) as Q8_0 blocks of its values, as llama.cpp rounds them. Each tensor
is made on the host alone and moved to the device, so the dense form never has to fit
anywhere, and no more than one tensor's planes are on the host at once (a mixture's: one
3-D tensor, all its experts). The embedding table is held the same way, its rows read by
id; a tied LM head is that same weight."""

from __future__ import annotations

import logging

import torch

from lucedesk.catalog.held_formats import HeldFormat
from lucedesk.engine.models.decoder import DecoderModel, Projection
from lucedesk.engine.models.gguf_blocks import BlockPart, dequantize_blocks
from lucedesk.engine.models.gguf_file import unpermute
from lucedesk.engine.models.moe import EXPERT_PROJECTIONS
from lucedesk.kernels.block_weights import BlockWeight, GroupedBlockWeight
from lucedesk.kernels.blocks import Planes, planes_from_blocks, q8_0_planes

log = logging.getLogger("lucedesk.engine.build")


def _planes(part: BlockPart, held: HeldFormat) -> Planes:
    rows, cols = part.shape
    if held.holds_as_is(part.type_name):
        planes = planes_from_blocks(part.raw, part.type_name, rows, cols)
    else:
        planes = q8_0_planes(dequantize_blocks(part.raw, part.type_name, (rows, cols)))
    if part.permuted_heads:  # llama.cpp's interleaved rotary rows, in their HF order
        planes = planes.rows(unpermute(torch.arange(rows), part.permuted_heads))
    return planes


def _runs(planes: list[Planes], experts: int = 1) -> list[Planes]:
    """Consecutive parts of one type as one run; with `experts`, each part's rows are
    that many experts' one after the other, and a run keeps each expert's rows together
    (its gate rows, then its up rows)."""
    runs: list[list[Planes]] = []
    for p in planes:
        if runs and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    if experts == 1:
        return [Planes.cat(run) for run in runs]
    joined = []
    for run in runs:
        rows = sum(p.shape[0] for p in run)
        tensors = [
            torch.cat(
                [t.view(experts, t.shape[0] // experts, t.shape[1]) for t in ts], dim=1
            ).reshape(rows, ts[0].shape[1])
            for ts in zip(*(p[1:] for p in run))
        ]
        joined.append(Planes(run[0].kind, *tensors))
    return joined


def _device(model: DecoderModel) -> torch.device:
    return model.norm.device


def _count(counts: dict, planes: list[Planes]) -> None:
    for p in planes:
        counts[p.kind] = counts.get(p.kind, 0) + 1


def projection_maker(model: DecoderModel, held: HeldFormat):
    """make(layer, proj, weight) -> a BlockWeight on the model's device (formats/)."""
    source, device = model.block_source, _device(model)
    counts: dict[str, int] = {}

    def make(layer: int | None, proj: str, weight: torch.Tensor) -> Projection:
        tied = model.config.tie_word_embeddings
        if layer is None and tied and model.embedding_held is not None:
            return model.embedding_held  # the tied LM head: the embedding's own blocks
        if source is None:  # a Hugging Face folder's weights: Q8_0 blocks of their values
            planes = [q8_0_planes(weight)]
        else:
            planes = [_planes(p, held) for p in source(layer, proj).parts()]
        _count(counts, planes)
        made = BlockWeight([run.to(device) for run in _runs(planes)])
        if layer is None:
            ways = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
            log.info(
                "weights %s: matmul weights held as blocks on %s (%s)", held.name, device, ways
            )
        return made

    return make


def hold_experts(model: DecoderModel, held: HeldFormat) -> None:
    """Each layer's experts, one 3-D tensor at a time, as GroupedBlockWeights."""
    source, device = model.expert_source, _device(model)
    for i, moe in model.moe_blocks():
        experts = moe.experts
        for proj in EXPERT_PROJECTIONS:
            count, n, k = experts.shapes[proj]
            param = getattr(experts, proj)
            if param.numel():  # read densely already (a Hugging Face folder's)
                planes = [q8_0_planes(param.detach().reshape(count * n, k).float())]
            else:
                planes = [_planes(p, held) for p in source.stacked_parts(i, proj)]
            runs = [run.to(device) for run in _runs(planes, count)]
            experts.quantized[proj] = GroupedBlockWeight(count, runs)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def hold_embedding(model: DecoderModel, held: HeldFormat) -> None:
    """The embedding table as blocks, its rows read by id (a tied LM head is the same)."""
    source, table = model.block_source, model.embed_tokens
    if source is None:
        if table.shape[-1] % 32:
            return  # rows not in whole blocks: kept in the model dtype
        planes = [q8_0_planes(table.detach().float())]
    else:
        planes = [_planes(p, held) for p in source(None, "embed_tokens").parts()]
    model.embedding_held = BlockWeight([run.to(_device(model)) for run in _runs(planes)])
    table.data = torch.empty(0, dtype=table.dtype, device=table.device)
