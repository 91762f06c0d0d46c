"""llama.cpp's block formats: the bytes of a tensor (or of one expert's slice of it) -> its
values in float32 (`dequantize_blocks`, any of SUPPORTED_TYPES), or for the level types ->
(levels uint8, d, m float32 per group of 32) with value = d * level + m, exactly as the
blocks hold it, for the low-bit kernels to take as is (`block_levels`).

    Q4_0 (18 bytes / 32):  fp16 d, 16 bytes of nibbles; value = d * (level - 8)
    Q4_1 (20 bytes / 32):  fp16 d and m; value = d * level + m
    Q4_K (144 bytes / 256): fp16 d and dmin, 12 bytes of 6-bit scales and mins for eight
                           groups of 32, 128 bytes of nibbles; value = d * scale * level
                           - dmin * min
    MXFP4 (17 bytes / 32): an E8M0 exponent e, 16 bytes of nibbles, each an e2m1 code;
                           value = code's value * 2^(e - 127). As levels: a 16-entry table
                           (kernels.quantized.MXFP4_LEVELS) maps code -> 2 * value + 12, with
                           d = 2^(e - 128) and m = -12 d.
    Q8_0 (34 bytes / 32):  fp16 d, 32 int8 q; value = d * q, as 8-bit levels q + 128 with
                           m = -128 d.
    Q5_0 (22 bytes / 32):  fp16 d, 32 high bits (a little-endian uint32, bit j value j's),
                           16 bytes of low nibbles; value = d * (level - 16), level in 0..31:
                           8-bit levels with m = -16 d.
    Q5_1 (24 bytes / 32):  fp16 d and m, then as Q5_0; value = d * level + m.
    Q6_K (210 bytes / 256): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales
                           (one per sixteen values), fp16 d; value = d * scale * (level - 32),
                           level in 0..63: 6-bit levels with d and m per sixteen values.
    IQ4_NL (18 bytes / 32): fp16 d, 16 bytes of nibbles (as Q4_0's), each a code of a
                           16-entry non-linear table; value = d * table[code]. As levels:
                           code -> table[code] + 128 (kernels.quantized.IQ4_LEVELS), m = -128 d.
    IQ4_XS (136 bytes / 256): fp16 d, 6-bit scales for eight groups of 32 (their low 4 bits
                           in 4 bytes, high 2 in a uint16), 128 bytes of nibbles, a group's
                           16 bytes as IQ4_NL's; value = d * (scale - 32) * table[code]: as
                           IQ4_NL's levels, each group's d its own (float32, exact).

In Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 a block's byte j of nibbles holds value j (low nibble)
and j + 16 (high); in Q4_K each 32 bytes hold two groups, the low nibbles the first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from lucedesk.catalog.held_formats import LOW_BIT_TYPES, READ_TYPES
from lucedesk.kernels.blocks import iq4_xs_scales, q6_k_levels
from lucedesk.kernels.quantized import IQ4_LEVELS, MXFP4_LEVELS

SUPPORTED_TYPES = READ_TYPES  # `dequantize_blocks` reads these
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # levels are the nibbles themselves
TABLES = {"MXFP4": MXFP4_LEVELS, "IQ4_NL": IQ4_LEVELS, "IQ4_XS": IQ4_LEVELS}  # code -> level
EIGHT_BIT_TYPES = ("Q5_0", "Q5_1", "Q8_0")  # levels below 256 with one d and m a group
LEVEL_TYPES = (*FOUR_BIT_TYPES, *TABLES, *EIGHT_BIT_TYPES, "Q6_K")  # `block_levels` holds exactly
GRID_TYPES = (*FOUR_BIT_TYPES, *EIGHT_BIT_TYPES)  # levels without a table: parts can be fused


class Levels(NamedTuple):
    """A grid a low-bit weight takes as it is: codes (nibbles or bytes) in value order,
    d and m per group of 32, the bit width, and for table formats the code -> level
    table. A K-quant's scales come `factors` too: d = d_factor * d_super and m = m_factor *
    m_super (uint8 per group of 32, float32 per super-block of 256), exactly. At 6 bits
    (Q6_K) d and m are per sixteen values, m = -32 d, and the factors (d_factor int8 per
    sixteen values, d_super float32 per 256) give d."""

    levels: np.ndarray
    d: np.ndarray
    m: np.ndarray
    bits: int
    table: tuple[int, ...] | None = None
    factors: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None


# llama.cpp's simple (not K-quant) block types: (has an fp16 m, bytes of high bits, m =
# -offset d without one); a block is fp16 d, the fp16 m, the high bits, 16 bytes of nibbles.
SIMPLE_BLOCKS = {
    "Q4_0": (False, 0, 8),
    "Q4_1": (True, 0, 0),
    "Q5_0": (False, 4, 16),
    "Q5_1": (True, 4, 0),
}


def _simple_groups(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, ...]:
    """Q4_0, Q4_1, Q5_0 or Q5_1 blocks -> (levels uint8 [values], d, m float32 [values /
    32]), in the tensor's value order."""
    has_m, high_bytes, offset = SIMPLE_BLOCKS[type_name]
    scales = 2 + 2 * has_m
    blocks = raw.reshape(-1, scales + high_bytes + 16)
    half = blocks[:, :scales].copy().view(np.float16).astype(np.float32)
    d = half[:, 0].copy()
    m = half[:, 1].copy() if has_m else -offset * d
    qs = blocks[:, -16:]
    levels = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    if high_bytes:  # bit j of a little-endian uint32 is value j's fifth bit
        levels |= np.unpackbits(blocks[:, scales : scales + 4], axis=1, bitorder="little") << 4
    return levels.reshape(-1), d, m


def _q4_k_groups(raw: np.ndarray) -> Levels:
    """Q4_K blocks -> levels uint8 [values], d, m float32 [values / 32]: each group's d and
    m its 6-bit scale and min times the super-block's, in the tensor's value order, with
    those factors."""
    from gguf.quants import Q4_K

    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    levels = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [blocks, 4, 2, 32]
    group_d = d * scales.astype(np.float32)
    group_m = -(dmin * mins.astype(np.float32))
    factors = (
        scales.reshape(-1).astype(np.uint8), d.reshape(-1),
        mins.reshape(-1).astype(np.uint8), -dmin.reshape(-1),
    )  # fmt: skip
    return Levels(levels.reshape(-1), group_d.reshape(-1), group_m.reshape(-1), 4, None, factors)


def _q6_k_groups(raw: np.ndarray) -> Levels:
    """Q6_K blocks -> levels uint8 [values] in 0..63, d = scale * d_super and m = -32 d
    float32 [values / 16], in the tensor's value order (as gguf's decoder orders them)."""
    levels, factor, super_ = q6_k_levels(raw.reshape(-1, 210))
    super_ = super_.astype(np.float32)
    d = (factor.astype(np.float32) * super_).reshape(-1)
    factors = (factor.reshape(-1), super_.reshape(-1))
    return Levels(levels, d, -32 * d, 6, None, factors)


def block_levels(raw: np.ndarray, type_name: str) -> Levels:
    """Any type of LEVEL_TYPES -> its levels; ValueError for another type."""
    if type_name in SIMPLE_BLOCKS:
        bits = 4 if type_name in FOUR_BIT_TYPES else 8
        return Levels(*_simple_groups(raw, type_name), bits=bits)
    if type_name == "Q4_K":
        return _q4_k_groups(raw)
    if type_name == "Q6_K":
        return _q6_k_groups(raw)
    if type_name == "MXFP4":
        from gguf.quants import MXFP4

        blocks = raw.reshape(-1, 17)
        d = MXFP4.e8m0_to_fp32_half(blocks[:, :1].copy()).reshape(-1)  # 2^(e - 128)
        qs = blocks[:, 1:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        return Levels(codes.reshape(-1), d, -12 * d, 4, MXFP4_LEVELS)
    if type_name in ("IQ4_NL", "IQ4_XS"):
        width = 18 if type_name == "IQ4_NL" else 136
        blocks = raw.reshape(-1, width)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
        qs = blocks[:, 2:] if type_name == "IQ4_NL" else blocks[:, 8:].reshape(-1, 8, 16)
        if type_name == "IQ4_XS":  # each group's d: the block's times its scale, exact
            d = d * iq4_xs_scales(blocks).astype(np.float32)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        d = d.reshape(-1)
        return Levels(codes.reshape(-1), d, -128 * d, 4, IQ4_LEVELS)
    if type_name == "Q8_0":
        blocks = raw.reshape(-1, 34)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        levels = blocks[:, 2:] ^ np.uint8(0x80)  # int8 q's bits -> q + 128, one copy
        return Levels(levels.reshape(-1), d, -128 * d, 8)
    raise ValueError(f"{type_name} blocks are not held as levels ({', '.join(LEVEL_TYPES)})")


def dequantize_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's bytes in one of SUPPORTED_TYPES -> its values as float32 `shape` (PyTorch
    order), through the gguf package's decoders for the block types."""
    from gguf import GGMLQuantizationType, quants

    if type_name == "F32":
        array = raw.view(np.float32).reshape(shape).copy()
    elif type_name == "F16":
        array = raw.view(np.float16).reshape(shape).astype(np.float32)
    else:
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        array = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType[type_name])
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
    return torch.from_numpy(array)


class BlockPart(NamedTuple):
    """One tensor of a fused projection as its file holds it: its bytes (a view of the
    file's map), GGUF type and [rows, cols], and the heads whose rotary rows llama.cpp's
    converter interleaved (0: none; see gguf_file.unpermute)."""

    raw: np.ndarray
    type_name: str
    shape: tuple[int, int]
    permuted_heads: int = 0


@dataclass(frozen=True)
class FileBlocks:
    """One fused projection's parts as the file holds them: their types, and their levels
    read and decoded only when `levels` is asked for, so checking a file's types costs
    nothing; the parts' bytes as they are (`parts`), and the fused weight's values read
    from the file (`values`, float32 [N, K]) for a weight held in another form."""

    types: tuple[str, ...]  # of the parts, in order
    decode: Callable[[], tuple[torch.Tensor, ...]]
    parts: Callable[[], list[BlockPart]] = list
    values: Callable[[], torch.Tensor] | None = None

    @property
    def table(self) -> tuple[int, ...] | None:
        """The code -> level table every part's codes look up (MXFP4's, IQ4's), or None."""
        tables = {TABLES.get(t) for t in self.types}
        return tables.pop() if len(tables) == 1 else None

    @property
    def type_name(self) -> str:
        """The first part's type that is not 4- or 5-bit, else the first part's (what a
        message about the projection names)."""
        return next((t for t in self.types if t not in LOW_BIT_TYPES), self.types[0])

    @property
    def bits(self) -> int | None:
        """4 where every part is in a 4-bit type, or all look up one table; 6 where every
        part is Q6_K, 8 where every part's levels are below 256 (4-bit ones among them),
        None where a part is not a grid of levels (or Q6_K with another type)."""
        if all(t in FOUR_BIT_TYPES for t in self.types) or self.table is not None:
            return 4
        if all(t == "Q6_K" for t in self.types):
            return 6
        return 8 if all(t in GRID_TYPES for t in self.types) else None

    @functools.cached_property
    def levels(self) -> tuple[torch.Tensor, ...] | None:
        """(levels uint8 [N, K], d and m float32 [N, K / 32]) with weight = d * level + m,
        exactly as the blocks hold it, then where every part is a K-quant d's and m's
        factors ([N, K / 32] uint8, [N, K / 256] float32 each, see Levels); None where
        `bits` is."""
        return None if self.bits is None else self.decode()
