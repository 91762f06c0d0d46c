"""Held weights as tensors and attributes, and back (engine/weight_cache.py keeps them on
disk): nothing is packed again when they come back."""

from __future__ import annotations

import torch

from lucedesk.kernels.checks import require
from lucedesk.kernels.cpu_build import load_cpu_ops
from lucedesk.kernels.quantized import (
    GroupedLowBitWeight,
    Int8Weight,
    LowBitWeight,
    QuantizedWeight,
    int8_tiles_available,
    lowbit_vector_available,
)

HELD = {cls.__name__: cls for cls in (Int8Weight, LowBitWeight, GroupedLowBitWeight)}


def packed_state(weight: QuantizedWeight) -> tuple[dict[str, torch.Tensor], dict]:
    """A held weight as its tensors (levels, scales, level table) and what else rebuilds it
    (`from_packed_state`): what a cache of held weights stores."""
    tensors = {"q": weight.q, "d": weight.d, "m": weight.m}
    attrs: dict = {"kind": type(weight).__name__, "shape": list(weight.shape)}
    if isinstance(weight, Int8Weight):
        attrs["tiles"] = weight.tiles
    else:
        attrs |= {"bits": weight.bits, "vector": weight.vector}
        if weight.lut is not None:
            tensors["lut"] = weight.lut
    if isinstance(weight, GroupedLowBitWeight):
        attrs["num_experts"] = weight.num_experts
    return tensors, attrs


def from_packed_state(tensors: dict[str, torch.Tensor], attrs: dict) -> QuantizedWeight:
    """The held weight `packed_state` described, on its tensors as they are (a mapped file's
    included): nothing is packed again. The kernels it names must run here (an 8-bit weight
    on AMX tiles needs them; the VNNI path needs VNNI)."""
    cls = HELD[attrs["kind"]]
    weight = cls.__new__(cls)
    weight.q, weight.d, weight.m = tensors["q"], tensors["d"], tensors["m"]
    weight.shape = tuple(attrs["shape"])
    if cls is Int8Weight:
        require(not attrs["tiles"] or int8_tiles_available(), "no AMX tiles here")
        weight.tiles = attrs["tiles"]
        ops = load_cpu_ops()
        weight._matmul = ops.int8_linear_tiles if weight.tiles else ops.int8_linear
        return weight
    require(not attrs["vector"] or lowbit_vector_available(), "no AVX512-VNNI here")
    weight._ops = load_cpu_ops()
    weight.bits, weight.vector, weight.lut = attrs["bits"], attrs["vector"], tensors.get("lut")
    if cls is GroupedLowBitWeight:
        weight.num_experts = attrs["num_experts"]
    return weight
