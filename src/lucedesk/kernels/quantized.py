"""Weights held quantized and multiplied by bfloat16 activations in C++: a weight is
w = d * level + m per group of 32 inputs, in one of three layouts, each its kernel's.

- `Int8Weight` (csrc/int8.h): any [N, K] weight as signed int8 levels, on AMX tiles where
  the CPU has them (the values pre-arranged for the tiles), else in plain loops.
- `LowBitWeight` (csrc/lowbit.h): one [N, K] weight as 4-, 6- or 8-bit levels.
- `GroupedLowBitWeight`: a mixture of experts' [N, K] weights as `LowBitWeight` holds one,
  multiplied in one grouped pass over (row, expert) pairs.

At 4 bits a level is either the nibble itself (llama.cpp's Q4_0, Q4_1 and Q4_K blocks) or a
nibble looked up in a 16-entry table (MXFP4's codes, see `MXFP4_LEVELS`); at 8 bits any
weight to within 1/510 of its group's range (`quantize_groups`), and Q8_0 blocks exactly;
6 bits are Q6_K's blocks as they are, w = d * (level - 32) with a d per sixteen inputs.
The low-bit kernels quantize activations per row to int8 with one scale per 32 inputs and
each group's dot product is exact integer arithmetic (AVX512-VNNI where the CPU has it,
plain loops elsewhere, the same bits either way). In every layout a row's result is
independent of its batch (and of the other rows of its expert).
"""

from __future__ import annotations

import torch

from lucedesk.kernels.blocks import IQ4_VALUES
from lucedesk.kernels.checks import require
from lucedesk.kernels.cpu_build import KernelUnavailable, load_cpu_ops
from lucedesk.kernels.levels import (
    affine,
    eight_bit,
    fits,
    held_values,
    pack_codes,
    pack_levels,
    quantize_rows,
    six_bit_held,
    unpack_levels,
)
from lucedesk.kernels.scales import (
    GROUP,
    channel_blocks,
    channel_rows,
    compact_scales,
    exact_factors,
    kquant_fits,
    kquant_scales,
    scale_rows,
)

# MXFP4 (e2m1) codes as levels: code c is 2 * value(c) + 12, so with d = scale / 2 and
# m = -12 d, w = d * level + m is exactly the code's value times the block's scale.
MXFP4_LEVELS = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)
# IQ4_NL's and IQ4_XS's codes as levels: code c is table[c] + 128, with m = -128 d.
IQ4_LEVELS = tuple(v + 128 for v in IQ4_VALUES)


def _cpu_has(probe: str) -> bool:
    try:
        return bool(getattr(load_cpu_ops(), probe)())
    except KernelUnavailable:
        return False


def int8_tiles_available() -> bool:
    """Whether int8 weights run on AMX tiles here (their fast path)."""
    return _cpu_has("int8_amx_available")


def lowbit_vector_available() -> bool:
    """Whether the 4/8-bit weight kernels run on AVX512-VNNI here (their fast path)."""
    return _cpu_has("lowbit_vector_available")


class QuantizedWeight:
    """What every held format shares: levels `q` with scales `d` and `m` per group of 32
    inputs, a C++ matmul that takes bfloat16 activations only, and its size in memory."""

    GROUP = GROUP
    KIND = "quantized"  # names the format in errors
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @classmethod
    def fits(cls, shape: tuple[int, ...]) -> bool:
        return fits(shape)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + (self.d.numel() + self.m.numel()) * self.d.element_size()

    def _activations(self, x: torch.Tensor) -> torch.Tensor:
        require(
            x.dtype == torch.bfloat16, f"{self.KIND} weights take bfloat16 inputs, got {x.dtype}"
        )
        return x.contiguous()


class Int8Weight(QuantizedWeight):
    """A [N, K] weight as int8 levels q in [-128, 127] (`quantize_groups`), on AMX tiles
    where the CPU has them and N allows, else in rows.

    Weights that came from a llama.cpp Q4_0/Q4_1/Q8_0/Q4_K file sit on such a grid already
    and come back exactly (to float rounding); any other group loses at most 1/510 of its
    range."""

    KIND = "int8"

    def __init__(self, weight: torch.Tensor) -> None:
        ops = load_cpu_ops()
        q, d, m = quantize_rows(weight)
        n, k = self.shape = tuple(weight.shape)
        self.tiles = int8_tiles_available() and n % 16 == 0
        if self.tiles:  # see csrc/int8.h: per 16 channels and 32 inputs, rows of input pairs
            self.q = q.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
            self.d, self.m = channel_blocks(d), channel_blocks(m)
        else:
            self.q, self.d, self.m = q.view(n, k).contiguous(), d.contiguous(), m.contiguous()
        self._matmul = ops.int8_linear_tiles if self.tiles else ops.int8_linear

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernels see it: [N, K] float32 (d * q + m, before bf16)."""
        if not self.tiles:
            return affine(self.q, self.d, self.m)
        q = self.q.permute(0, 3, 1, 2, 4).reshape(self.shape)
        return affine(q, channel_rows(self.d), channel_rows(self.m))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] bfloat16 -> [M, N] bfloat16."""
        return self._matmul(self._activations(x), self.q, self.d, self.m)


class _LowBit(QuantizedWeight):
    """The low-bit kernels' settings: bit width, optional 16-entry level table, and the VNNI
    path or the plain loops (default: VNNI where available)."""

    KIND = "low-bit"

    def __init__(self, bits: int, table: tuple[int, ...] | None, vector: bool | None) -> None:
        require(table is None or bits == 4, "a level table is for 4-bit weights")
        if table is not None:
            in_range = all(0 <= v < 256 for v in table)
            require(len(table) == 16 and in_range, "a level table has 16 bytes")
        self._ops = load_cpu_ops()
        self.bits = bits
        self.lut = None if table is None else torch.tensor(table, dtype=torch.uint8)
        self.vector = lowbit_vector_available() if vector is None else vector


class LowBitWeight(_LowBit):
    """A [N, K] weight as 4-, 6- or 8-bit levels: weights never widened in memory; a
    decode step reads 0.59 (4-bit, K-quant scales) to 1.25 (8-bit, float32 scales) bytes a
    weight, 0.83 at 6 bits."""

    def __init__(
        self,
        levels: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        bits: int,
        vector: bool | None = None,
        table: tuple[int, ...] | None = None,
        factors: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """levels: uint8 [N, K] below 2**bits (with `table`: nibbles indexing it); d, m:
        float32 [N, K / 32]; `factors` (a K-quant's, see gguf_blocks.Levels), where they
        give d and m exactly, are held in their stead (0.59 bytes a 4-bit weight). At 6 bits
        d and m are per sixteen inputs and the factors are needed (`six_bit_held`)."""
        super().__init__(bits, table, vector)
        self.shape = tuple(levels.shape)
        if bits == 6:
            self.q = pack_codes(levels, bits)
            self.d, self.m = six_bit_held(d, m, factors)
        elif exact_factors(d, m, factors):
            self.q = pack_levels(levels, d, m, bits)[0]
            self.d, self.m = kquant_scales(*factors[:2]), kquant_scales(*factors[2:])
        else:
            self.q, d, m = pack_levels(levels, d, m, bits)
            self.d, self.m = compact_scales(d, m, bits)

    @classmethod
    def from_float(cls, weight: torch.Tensor, vector: bool | None = None) -> LowBitWeight:
        """Any [N, K] weight as 8-bit levels (see `quantize_groups`)."""
        return cls(*eight_bit(weight), bits=8, vector=vector)

    def levels(self) -> torch.Tensor:
        """The levels back in [N, K] order (table entries where there is a table)."""
        return unpack_levels(self.q, self.bits, *self.shape, self.lut)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: d * level + m."""
        return held_values(self.levels(), self.d, self.m, self.bits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] bfloat16 -> [M, N] bfloat16."""
        return self._ops.lowbit_linear(
            self._activations(x), self.q, self.d, self.m, self.bits, self.vector, self.lut
        )


class GroupedLowBitWeight(_LowBit):
    """The [N, K] weights of `num_experts` experts, each as `LowBitWeight` holds one, all
    at one bit width; filled one expert at a time (`set`), so no more than one expert is
    ever unpacked at once."""

    def __init__(
        self,
        num_experts: int,
        shape: tuple[int, int],
        bits: int,
        table: tuple[int, ...] | None = None,
        vector: bool | None = None,
        kquant: bool = False,
    ) -> None:
        """`kquant`: every expert comes with K-quant factors (`set`), held in the stead of
        d and m."""
        n, k = shape
        require(fits(shape), f"low-bit weights need N % 16 == 0 and K % 32 == 0, got {n}x{k}")
        require(not (kquant or bits == 6) or kquant_fits(k), "K-quant scales need K % 256 == 0")
        super().__init__(bits, table, vector)
        self.num_experts, self.shape = num_experts, (n, k)
        self.q = torch.zeros(num_experts, n // 16, k // 32, 64 * bits, dtype=torch.uint8)
        if bits == 6:  # (no m)
            self.d = torch.zeros(num_experts, n // 16, k // 32 * 40, dtype=torch.int8)
            self.m = torch.zeros(num_experts, 0, dtype=torch.int8)
            return
        if kquant:
            self.d = torch.zeros(num_experts, n // 16, k // 32 * 24, dtype=torch.uint8)
        else:
            self.d = torch.zeros(num_experts, n // 16, k // 32, 16)
        self.m = torch.zeros_like(self.d)

    @property
    def kquant(self) -> bool:
        return self.d.dtype == torch.uint8

    @property
    def takes_factors(self) -> bool:
        """Whether `set` takes each expert's scale factors (K-quant and 6-bit weights)."""
        return self.kquant or self.bits == 6

    def _widen_scales(self) -> None:
        """K-quant scales -> float32 ones, for the experts set so far (the rest are zero)."""
        k = self.shape[1]
        self.d, self.m = (
            torch.stack([channel_blocks(scale_rows(s[e], k)) for e in range(self.num_experts)])
            for s in (self.d, self.m)
        )

    def compact(self) -> None:
        """Once every expert is set: the group scales in the fewest bytes that give them
        exactly (`compact_scales`: an MXFP4 file's as exponent bytes, 0.53 bytes a weight;
        a Q4_1, Q5_0 or Q5_1 file's in float16, an 8-bit weight 1.125 instead of 1.25; a
        Q4_0 or Q8_0 file's d alone, m implied: 1.0625), the same bits."""
        if not self.takes_factors:
            self.d, self.m = compact_scales(self.d, self.m, self.bits)

    def set(
        self,
        expert: int,
        levels: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        *factors: torch.Tensor,
    ) -> None:
        """One expert's levels (uint8 [N, K]) and group scales (float32 [N, K / 32]), and
        where the weight holds K-quant scales their factors (gguf_blocks.Levels); factors
        that do not give the scales exactly turn every expert's scales to float32."""
        require(tuple(levels.shape) == self.shape, f"expert weights must be {self.shape}")
        if self.bits == 6:
            self.q[expert] = pack_codes(levels, 6)
            self.d[expert] = six_bit_held(d, m, factors)[0]
            return
        self.q[expert], d_blocks, m_blocks = pack_levels(levels, d, m, self.bits)
        if self.kquant and not exact_factors(d, m, factors):
            self._widen_scales()  # (a damaged super-block scale): float32 scales for all
        if self.kquant:
            self.d[expert], self.m[expert] = (
                kquant_scales(*factors[:2]),
                kquant_scales(*factors[2:]),
            )
        else:
            self.d[expert], self.m[expert] = d_blocks, m_blocks

    def dequantize(self, expert: int) -> torch.Tensor:
        """One expert's [N, K] float32 weight."""
        levels = unpack_levels(self.q[expert], self.bits, *self.shape, self.lut)
        return held_values(levels, self.d[expert], self.m[expert], self.bits)

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pair p is x's row rows[p] (row p without `rows`) times expert experts[p]'s
        weight: x [R, K] bfloat16, experts and rows [P] -> [P, N] bfloat16 in pair order.
        The C++ pass groups the pairs by expert and reads each chosen expert once."""
        return self._ops.lowbit_moe_linear(
            self._activations(x),
            None if rows is None else rows.to(torch.int64).contiguous(),
            experts.to(torch.int64).contiguous(),
            self.q,
            self.d,
            self.m,
            self.bits,
            self.vector,
            self.lut,
        )
