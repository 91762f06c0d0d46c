"""A mixture's expert weights: read from a GGUF file one expert at a time, and held either
densely in the model dtype or as low-bit weights taken from the file's own blocks.

The experts are most of an MoE model's bytes (Qwen3-30B-A3B: 29 of 30 B parameters), so a
model loaded from a GGUF file keeps them in the file until the weight format is chosen: as
4-bit (Q4_0/Q4_1/Q4_K, MXFP4) or 8-bit (Q5_0/Q5_1/Q8_0) levels exactly as the blocks hold
them, never widened; other types are widened one expert at a time and held at 8 bits."""

from __future__ import annotations

import logging

import numpy as np
import torch

from lucedesk.engine.models.decoder import DecoderModel
from lucedesk.engine.models.gguf_blocks import LEVEL_TYPES, BlockPart, Levels
from lucedesk.engine.models.moe import EXPERT_PROJECTIONS

log = logging.getLogger(__name__)


class GGUFExperts:
    """The expert tensors of a GGUF file (gguf_file.GGUFFile)."""

    def __init__(self, gguf) -> None:
        self.gguf = gguf

    def type_name(self, layer: int, proj: str) -> str:
        return self.gguf.expert_tensors(layer, proj)[0].type_name

    def expert(self, layer: int, proj: str, expert: int) -> torch.Tensor:
        """One expert's [N, K] weight in float32 (gate rows before up rows)."""
        parts = self.gguf.expert_tensors(layer, proj)
        return torch.cat([self.gguf.dequantize_expert(t, expert) for t in parts])

    def stacked_parts(self, layer: int, proj: str) -> list[BlockPart]:
        """The 3-D tensors behind `proj` (gate then up), each as one [experts x rows, cols]
        part: the experts' blocks one after the other, as the file holds them."""
        parts = []
        for t in self.gguf.expert_tensors(layer, proj):
            count, rows, cols = t.shape
            parts.append(BlockPart(self.gguf.raw(t), t.type_name, (count * rows, cols)))
        return parts

    def levels(self, layer: int, proj: str, expert: int) -> Levels | None:
        """One expert's weight as the file's levels, or None where its blocks are not a
        level grid (or gate and up differ in kind)."""
        parts = self.gguf.expert_tensors(layer, proj)
        if any(t.type_name not in LEVEL_TYPES for t in parts):
            return None
        found = [self.gguf.expert_levels(t, expert) for t in parts]
        if len({(lv.bits, lv.table) for lv in found}) != 1:
            return None
        factors = None
        if all(lv.factors is not None for lv in found):
            factors = tuple(np.concatenate(f) for f in zip(*(lv.factors for lv in found)))
        return Levels(
            *(np.concatenate([getattr(lv, f) for lv in found]) for f in ("levels", "d", "m")),
            bits=found[0].bits,
            table=found[0].table,
            factors=factors,
        )


def materialize_dense(model: DecoderModel) -> None:
    """Every expert weight still in its file, read densely into the model dtype."""
    source = model.expert_source
    for i, moe in model.moe_blocks():
        experts = moe.experts
        for proj in EXPERT_PROJECTIONS:
            param = getattr(experts, proj)
            if param.numel() or proj in experts.quantized:
                continue
            count = experts.shapes[proj][0]
            dense = torch.stack(  # each expert cast alone: float32 only one at a time
                [source.expert(i, proj, e).to(model.dtype) for e in range(count)]
            )
            param.data = dense.to(model.embed_tokens.device)


def quantize_experts(model: DecoderModel, weights: str) -> None:
    """Every expert weight as low-bit levels: for `q4`, the file's 4-, 6- or 8-bit levels
    where its blocks are a grid; for `int8`, its 8-bit levels (Q5_0/Q5_1/Q8_0) where they
    are; else each expert widened alone and held at 8 bits. Dense copies are released."""
    from lucedesk.kernels.levels import eight_bit
    from lucedesk.kernels.quantized import GroupedLowBitWeight
    from lucedesk.kernels.scales import kquant_fits

    source = model.expert_source
    wider: dict[str, int] = {}
    for i, moe in model.moe_blocks():
        experts = moe.experts
        for proj in EXPERT_PROJECTIONS:
            count, n, k = experts.shapes[proj]
            param = getattr(experts, proj)
            first = source.levels(i, proj, 0) if source is not None else None
            exact = first is not None and (weights == "q4" or first.bits == 8)
            if exact:
                kquant = first.factors is not None and kquant_fits(k)
                held = GroupedLowBitWeight(count, (n, k), first.bits, first.table, kquant=kquant)
            else:
                kind = source.type_name(i, proj) if source is not None else str(model.dtype)
                wider[kind] = wider.get(kind, 0) + 1
                held = GroupedLowBitWeight(count, (n, k), 8)
            for e in range(count):
                if exact:
                    lv = first if e == 0 else source.levels(i, proj, e)
                    parts = (torch.from_numpy(lv.levels).view(n, k),) + tuple(
                        torch.from_numpy(a).view(n, -1) for a in (lv.d, lv.m)
                    )
                    if held.takes_factors:
                        parts += tuple(torch.from_numpy(a).view(n, -1) for a in lv.factors)
                else:
                    w = param[e] if param.numel() else source.expert(i, proj, e)
                    parts = eight_bit(w.float())
                held.set(e, *parts)
            held.compact()
            experts.quantized[proj] = held
            param.data = torch.empty(0, dtype=param.dtype)
    if wider:
        kinds = ", ".join(f"{n} in {t}" for t, n in sorted(wider.items()))
        log.info("weights %s: expert weights held at 8 bits from their values (%s)", weights, kinds)


def experts_fit(model: DecoderModel) -> bool:
    """Whether every expert weight has whole 16-channel blocks and 32-input groups."""
    from lucedesk.kernels.levels import fits

    return all(
        fits(moe.experts.shapes[proj][1:])
        for _, moe in model.moe_blocks()
        for proj in EXPERT_PROJECTIONS
    )
