"""The C++ kernels' held formats (q4, int8 on the cpu kernels): each weight as the file's
levels where its blocks are grids, at 4 bits where every part is 4-bit (or looks up one
16-entry table: MXFP4's, IQ4's), at 6 where every part is Q6_K, else (and for int8) at 8
bits, the scales float16 where the file's are (int8 takes a Q6_K weight from its values);
any other weight at 8 bits from its values. int8 where the VNNI kernels do not run
(Int8Weight: on AMX tiles, or in plain rows) takes every weight from its values. A log line
(after the LM head, the last weight) says how many weights were held which way, by type."""

from __future__ import annotations

import logging

import torch

from lucedesk.catalog.held_formats import HeldFormat
from lucedesk.engine.models.decoder import DecoderModel, Projection
from lucedesk.engine.models.expert_weights import quantize_experts

log = logging.getLogger("lucedesk.engine.build")


def projection_maker(model: DecoderModel, held: HeldFormat):
    """make(layer, proj, weight) -> the held weight (see the module's top)."""
    from lucedesk.kernels.quantized import Int8Weight, LowBitWeight, lowbit_vector_available

    source = model.block_source
    wanted = held.name
    low_bit = wanted == "q4" or lowbit_vector_available()
    counts: dict[tuple[str, str], int] = {}

    def make(layer: int | None, proj: str, weight: torch.Tensor) -> Projection:
        blocks = None if source is None else source(layer, proj)
        head = (model.config.vocab_size, model.config.hidden_size)
        shape = head if layer is None else model.layers[layer].shapes[proj]

        def values() -> torch.Tensor:  # read from the file where left there, this one alone
            if weight.numel() == 0 and blocks is not None and blocks.values is not None:
                return blocks.values().to(model.dtype)
            return weight

        bits = None if blocks is None else blocks.bits
        if not (low_bit and LowBitWeight.fits(shape)):
            made: Projection = Int8Weight(values())
            how = "at 8 bits from their values"
        elif bits is not None and (wanted == "q4" or bits != 6):
            bits = bits if wanted == "q4" else 8
            table = blocks.table if bits == 4 else None
            levels, d, m, *factors = blocks.levels
            if blocks.table is not None and bits == 8:  # a table's codes at 8 bits: its levels
                levels = torch.tensor(blocks.table, dtype=torch.uint8)[levels.long()]
            factors = tuple(factors) or None
            made = LowBitWeight(levels, d, m, bits=bits, table=table, factors=factors)
            how = f"at {bits} bits as the file's levels"
        else:
            made = LowBitWeight.from_float(values())
            how = "at 8 bits from their values"
        kinds = blocks.types if blocks is not None else [str(weight.dtype).removeprefix("torch.")]
        kind = "+".join(dict.fromkeys(kinds))
        counts[how, kind] = counts.get((how, kind), 0) + 1
        if layer is None:
            ways = "; ".join(f"{n} {how} ({kind})" for (how, kind), n in sorted(counts.items()))
            log.info("weights %s: matmul weights held %s", wanted, ways)
        return made

    return make


def hold_experts(model: DecoderModel, held: HeldFormat) -> None:
    quantize_experts(model, held.name)
