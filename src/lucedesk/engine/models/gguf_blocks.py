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

In Q4_0, Q4_1 and MXFP4 a block's byte j holds value j (low nibble) and j + 16 (high); in
Q4_K each 32 bytes hold two groups, the low nibbles the first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from lucedesk.kernels.quantized import MXFP4_LEVELS

SUPPORTED_TYPES = (  # `dequantize_blocks` reads these
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",
)
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # levels are the nibbles themselves
LEVEL_TYPES = (*FOUR_BIT_TYPES, "MXFP4", "Q8_0")  # held exactly by `block_levels`


class Levels(NamedTuple):
    """A grid a low-bit weight takes as it is: codes (nibbles or bytes) in value order,
    d and m per group of 32, the bit width, and for table formats the code -> level
    table."""

    levels: np.ndarray
    d: np.ndarray
    m: np.ndarray
    bits: int
    table: tuple[int, ...] | None = None


def four_bit_groups(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of a 4-bit type -> (levels uint8 [values], d, m float32 [values / 32]), level
    in 0..15, in the tensor's value order."""
    if type_name in ("Q4_0", "Q4_1"):
        blocks = raw.reshape(-1, 18 if type_name == "Q4_0" else 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        if type_name == "Q4_0":
            m, qs = -8 * d, blocks[:, 2:]
        else:
            m, qs = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0], blocks[:, 4:]
        levels = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        return levels.reshape(-1), d, m
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        scales, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        levels = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [blocks, 4, 2, 32]
        group_d = d * scales.astype(np.float32)
        group_m = -(dmin * mins.astype(np.float32))
        return levels.reshape(-1), group_d.reshape(-1), group_m.reshape(-1)
    raise ValueError(f"{type_name} is not a 4-bit type ({', '.join(FOUR_BIT_TYPES)})")


def block_levels(raw: np.ndarray, type_name: str) -> Levels:
    """Any type of LEVEL_TYPES -> its levels; ValueError for another type."""
    if type_name in FOUR_BIT_TYPES:
        return Levels(*four_bit_groups(raw, type_name), bits=4)
    if type_name == "MXFP4":
        from gguf.quants import MXFP4

        blocks = raw.reshape(-1, 17)
        d = MXFP4.e8m0_to_fp32_half(blocks[:, :1].copy()).reshape(-1)  # 2^(e - 128)
        qs = blocks[:, 1:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        return Levels(codes.reshape(-1), d, -12 * d, 4, MXFP4_LEVELS)
    if type_name == "Q8_0":
        blocks = raw.reshape(-1, 34)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        q = blocks[:, 2:].copy().view(np.int8).astype(np.int16)
        return Levels((q + 128).astype(np.uint8).reshape(-1), d, -128 * d, 8)
    raise ValueError(f"{type_name} blocks are not held as levels ({', '.join(LEVEL_TYPES)})")


def four_bit_matrix(
    raw: np.ndarray, type_name: str, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [rows, cols] tensor's blocks of a 4-bit type -> (levels uint8 [rows, cols], d and m
    float32 [rows, cols / 32])."""
    rows, cols = shape
    levels, d, m = (torch.from_numpy(a) for a in four_bit_groups(raw, type_name))
    return levels.view(rows, cols), d.view(rows, -1), m.view(rows, -1)


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


@dataclass(frozen=True)
class FourBitBlocks:
    """One fused projection's blocks; read and decoded only when `groups` is asked for, so
    checking a file's types costs nothing."""

    type_name: str  # the first part not in a 4-bit type, else the first part's
    decode: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None

    @property
    def four_bit(self) -> bool:
        return self.decode is not None

    @functools.cached_property
    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(levels, d, m), or None when a part is not in a 4-bit type."""
        return None if self.decode is None else self.decode()
