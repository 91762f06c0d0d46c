"""Weights held as 4- or 8-bit levels, multiplied in C++ (csrc/lowbit.h): one matrix
(`LowBitWeight`), or a mixture of experts' matrices multiplied in one grouped pass over
(row, expert) pairs (`GroupedLowBitWeight`).

A weight is w = d * level + m per group of 32 inputs. At 4 bits a level is either the nibble
itself (llama.cpp's Q4_0, Q4_1 and Q4_K blocks) or a nibble looked up in a 16-entry table
(MXFP4's codes, see `MXFP4_LEVELS`); at 8 bits any weight to within 1/510 of its group's
range, and Q8_0 blocks exactly. Activations are quantized per row to int8 with one scale per
32 inputs and each group's dot product is exact integer arithmetic (AVX512-VNNI where the
CPU has it, plain loops elsewhere, the same bits either way), so every row's result is
independent of its batch and of the other rows of its expert.
"""

from __future__ import annotations

import torch

from lucedesk.kernels.checks import require
from lucedesk.kernels.cpu import Int8Weight, load_cpu_ops, lowbit_vector_available, quantize_groups

GROUP = 32
# MXFP4 (e2m1) codes as levels: code c is 2 * value(c) + 12, so with d = scale / 2 and
# m = -12 d, w = d * level + m is exactly the code's value times the block's scale.
MXFP4_LEVELS = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)


def fits(shape: tuple[int, ...]) -> bool:
    """Whether a [N, K] weight can be held this way: whole groups, whole 16-channel blocks."""
    n, k = shape[-2:]
    return k % GROUP == 0 and n % 16 == 0


def pack_levels(
    levels: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """levels uint8 [N, K] (below 2**bits), d and m float32 [N, K / 32] -> the kernels'
    layout: q [N/16, K/32, 64 * bits], d and m [N/16, K/32, 16]."""
    n, k = levels.shape
    require(bits in (4, 8), f"bits must be 4 or 8, got {bits}")
    require(fits((n, k)), f"low-bit weights need N % 16 == 0 and K % 32 == 0, got {n}x{k}")
    require(levels.dtype == torch.uint8, f"levels must be uint8, got {levels.dtype}")
    require(
        tuple(d.shape) == tuple(m.shape) == (n, k // GROUP),
        f"group scales must be [{n}, {k // GROUP}], got {tuple(d.shape)}",
    )
    # [N/16, 16 channels, K/32, 8 quads, 4] -> [N/16, K/32, 8 quads, 16 channels, 4]
    v = levels.view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, 512)
    if bits == 4:
        require(int(levels.max()) < 16 if levels.numel() else True, "4-bit levels exceed 15")
        v = v[:, :256] | (v[:, 256:] << 4)
    q = v.reshape(n // 16, k // 32, 64 * bits).contiguous()
    d = d.float().reshape(n // 16, 16, k // 32).transpose(1, 2).contiguous()
    m = m.float().reshape(n // 16, 16, k // 32).transpose(1, 2).contiguous()
    return q, d, m


def unpack_levels(
    q: torch.Tensor, bits: int, n: int, k: int, lut: torch.Tensor | None = None
) -> torch.Tensor:
    """The levels back in [N, K] order (the stored codes looked up where there is a
    table)."""
    v = torch.cat([q & 0x0F, q >> 4], dim=-1) if bits == 4 else q
    codes = v.reshape(n // 16, k // 32, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
    return codes if lut is None else lut[codes.long()]


def dequantize(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, lut: torch.Tensor | None
) -> torch.Tensor:
    """A packed weight (pack_levels' layout) as [N, K] float32: d * level + m."""
    n, k = d.shape[0] * 16, d.shape[1] * 32
    d = d.transpose(1, 2).reshape(n, -1, 1)
    m = m.transpose(1, 2).reshape(n, -1, 1)
    return (unpack_levels(q, bits, n, k, lut).float().view(n, -1, 32) * d + m).view(n, k)


def eight_bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Any [N, K] weight as 8-bit (levels, d, m) (see `quantize_groups`)."""
    n, k = weight.shape
    require(k % GROUP == 0, f"low-bit weights need inputs in groups of 32, got {k}")
    parts = [
        quantize_groups(rows.float().view(-1, k // GROUP, GROUP))
        for rows in weight.detach().split(Int8Weight.ROWS_AT_ONCE)
    ]
    q, d, m = (torch.cat(t) for t in zip(*parts))
    levels = (q.to(torch.int16) + 128).to(torch.uint8).view(n, k)
    return levels, d, m - 128 * d


def _lut(table: tuple[int, ...] | None) -> torch.Tensor | None:
    if table is None:
        return None
    require(len(table) == 16 and all(0 <= v < 256 for v in table), "a level table has 16 bytes")
    return torch.tensor(table, dtype=torch.uint8)


class LowBitWeight:
    """A [N, K] weight as 4- or 8-bit levels: weights never widened in memory; a decode
    step reads 0.75 (4-bit) or 1.25 (8-bit) bytes a weight."""

    GROUP = GROUP

    @classmethod
    def fits(cls, shape: tuple[int, ...]) -> bool:
        return fits(shape)

    def __init__(
        self,
        levels: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        bits: int,
        vector: bool | None = None,
        table: tuple[int, ...] | None = None,
    ) -> None:
        """levels: uint8 [N, K] below 2**bits (with `table`: nibbles indexing it); d, m:
        float32 [N, K / 32]. `vector`: the VNNI path or the plain loops (default: VNNI
        where available)."""
        self._ops = load_cpu_ops()
        require(table is None or bits == 4, "a level table is for 4-bit weights")
        self.shape, self.bits = tuple(levels.shape), bits
        self.q, self.d, self.m = pack_levels(levels, d, m, bits)
        self.lut = _lut(table)
        self.vector = lowbit_vector_available() if vector is None else vector

    @classmethod
    def from_float(cls, weight: torch.Tensor, vector: bool | None = None) -> LowBitWeight:
        """Any [N, K] weight as 8-bit levels (see `quantize_groups`)."""
        return cls(*eight_bit(weight), bits=8, vector=vector)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + (self.d.numel() + self.m.numel()) * 4

    def levels(self) -> torch.Tensor:
        """The levels back in [N, K] order (table entries where there is a table)."""
        return unpack_levels(self.q, self.bits, *self.shape, self.lut)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: d * level + m."""
        return dequantize(self.q, self.d, self.m, self.bits, self.lut)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] bfloat16 -> [M, N] bfloat16."""
        require(x.dtype == torch.bfloat16, f"low-bit weights take bfloat16 inputs, got {x.dtype}")
        return self._ops.lowbit_linear(
            x.contiguous(), self.q, self.d, self.m, self.bits, self.vector, self.lut
        )


class GroupedLowBitWeight:
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
    ) -> None:
        n, k = shape
        require(fits(shape), f"low-bit weights need N % 16 == 0 and K % 32 == 0, got {n}x{k}")
        require(table is None or bits == 4, "a level table is for 4-bit weights")
        self._ops = load_cpu_ops()
        self.num_experts, self.shape, self.bits = num_experts, (n, k), bits
        self.q = torch.zeros(num_experts, n // 16, k // 32, 64 * bits, dtype=torch.uint8)
        self.d = torch.zeros(num_experts, n // 16, k // 32, 16)
        self.m = torch.zeros_like(self.d)
        self.lut = _lut(table)
        self.vector = lowbit_vector_available() if vector is None else vector

    def set(self, expert: int, levels: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """One expert's levels (uint8 [N, K]) and group scales (float32 [N, K / 32])."""
        require(tuple(levels.shape) == self.shape, f"expert weights must be {self.shape}")
        self.q[expert], self.d[expert], self.m[expert] = pack_levels(levels, d, m, self.bits)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + (self.d.numel() + self.m.numel()) * 4

    def dequantize(self, expert: int) -> torch.Tensor:
        """One expert's [N, K] float32 weight."""
        return dequantize(self.q[expert], self.d[expert], self.m[expert], self.bits, self.lut)

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pair p is x's row rows[p] (row p without `rows`) times expert experts[p]'s
        weight: x [R, K] bfloat16, experts and rows [P] -> [P, N] bfloat16 in pair order.
        The C++ pass groups the pairs by expert and reads each chosen expert once."""
        require(x.dtype == torch.bfloat16, f"low-bit weights take bfloat16 inputs, got {x.dtype}")
        return self._ops.lowbit_moe_linear(
            x.contiguous(),
            None if rows is None else rows.to(torch.int64).contiguous(),
            experts.to(torch.int64).contiguous(),
            self.q,
            self.d,
            self.m,
            self.bits,
            self.vector,
            self.lut,
        )
