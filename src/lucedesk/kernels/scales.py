"""The group scales of the low-bit kernels' weights, as they are laid out for them
(csrc/lowbit.h): float32 or float16 per sixteen channels and group of 32 inputs, or a
K-quant's uint8 factors with float32 super-block scales, or exponent bytes where every d is
a power of two and m = -12 d (MXFP4's), or float16 d alone where m = -2^(bits - 1) d
(symmetric levels: Q8_0's and Q4_0's), or a 6-bit weight's int8 factors per sixteen inputs
with float32 super-block scales; and back to rows."""

from __future__ import annotations

import torch

GROUP = 32
SUPER = 256  # a K-quant super-block: eight groups sharing one scale the groups' factors multiply
HALF = 16  # a 6-bit weight's scales: one per sixteen inputs
EXPONENT = torch.float8_e8m0fnu  # MXFP4's scales as its blocks hold them: d = 2^(e - 128)


def channel_blocks(scales: torch.Tensor) -> torch.Tensor:
    """Group scales [N, K / 32] -> the kernels' [N / 16, K / 32, 16]: for each block of 16
    channels and each group, the 16 channels' scales side by side."""
    n, groups = scales.shape
    return scales.float().reshape(n // 16, 16, groups).transpose(1, 2).contiguous()


def channel_rows(blocks: torch.Tensor) -> torch.Tensor:
    """`channel_blocks` undone: [N / 16, K / 32, 16] -> [N, K / 32] float32."""
    return blocks.float().transpose(1, 2).reshape(-1, blocks.shape[1])


def kquant_fits(k: int) -> bool:
    """Whether a weight of K inputs can hold K-quant scales (whole super-blocks of 256)."""
    return k % SUPER == 0


def factor_scales(factor: torch.Tensor, super_: torch.Tensor) -> torch.Tensor:
    """Scales held as a factor times a super-block scale, factor [N, F] (F per channel) and
    super float32 [N, K / 256] -> the kernels' layout in the factor's dtype, [N / 16, ...]:
    per block of sixteen channels its factors [F, 16], then its super scales [K / 256, 16]
    as float32 bytes (csrc/lowbit.h)."""
    n, per_channel = factor.shape
    factors = factor.reshape(n // 16, 16, per_channel).transpose(1, 2)
    supers = super_.float().reshape(n // 16, 16, -1).transpose(1, 2).contiguous()
    supers = supers.view(factor.dtype)
    return torch.cat([factors.reshape(n // 16, -1), supers.reshape(n // 16, -1)], 1).contiguous()


def factor_rows(scales: torch.Tensor, per_channel: int) -> torch.Tensor:
    """`factor_scales` undone: -> [N, per_channel] float32 factor * super."""
    blocks = scales.shape[0]
    factors = scales[:, : per_channel * 16].reshape(blocks, per_channel, 16).float()
    supers = scales[:, per_channel * 16 :].contiguous().view(torch.float32).view(blocks, -1, 16)
    return channel_rows(factors * supers.repeat_interleave(per_channel // supers.shape[1], dim=1))


def factor_values(factor: torch.Tensor, super_: torch.Tensor) -> torch.Tensor:
    """factor [N, F] times its super-block's scale, super [N, K / 256] -> [N, F] float32."""
    per = factor.shape[1] // super_.shape[1]
    return factor.float() * super_.float().repeat_interleave(per, dim=1)


def kquant_scales(factor: torch.Tensor, super_: torch.Tensor) -> torch.Tensor:
    """K-quant scales, factor uint8 [N, K / 32] and super float32 [N, K / 256] (scale =
    factor * super) -> the kernels' uint8 [N / 16, K / 32 * 24] (`factor_scales`)."""
    return factor_scales(factor.to(torch.uint8), super_)


def six_bit_scales(factor: torch.Tensor, super_: torch.Tensor) -> torch.Tensor:
    """A 6-bit weight's scales (Q6_K's), factor int8 [N, K / 16] and super float32
    [N, K / 256] (d = factor * super for sixteen inputs) -> the kernels' int8
    [N / 16, K / 32 * 40] (`factor_scales`: a group's first sixteen inputs' factors, then
    its second sixteen's)."""
    return factor_scales(factor.to(torch.int8), super_)


def six_bit_rows(scales: torch.Tensor, k: int) -> torch.Tensor:
    """`six_bit_scales` undone: -> d float32 [N, K / 16]."""
    return factor_rows(scales, k // HALF)


def implied_offset(d: torch.Tensor, bits: int) -> float | None:
    """m as a multiple of d where the kernels hold d alone (exponent scales: -12; symmetric
    float16 ones: -2^(bits - 1)), else None (m is held)."""
    if d.dtype == EXPONENT:
        return -12.0
    return None if d.dtype != torch.float16 else -float(1 << (bits - 1))


def held_rows(
    d: torch.Tensor, m: torch.Tensor, k: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A `bits` weight's d and m as the kernels hold them -> both [N, K / 32] float32."""
    rows = scale_rows(d, k)
    ratio = implied_offset(d, bits) if m.numel() == 0 else None
    return (rows, ratio * rows) if ratio is not None else (rows, scale_rows(m, k))


def scale_rows(scales: torch.Tensor, k: int) -> torch.Tensor:
    """A weight's group scales as the kernels hold them -> [N, K / 32] float32."""
    if scales.dtype == EXPONENT:  # 2^(e - 127) as the dtype reads it; d is half that
        return channel_rows(scales.float() / 2)
    if scales.dtype != torch.uint8:
        return channel_rows(scales)
    return factor_rows(scales, k // GROUP)


def exact_factors(
    d: torch.Tensor, m: torch.Tensor, factors: tuple[torch.Tensor, ...] | None
) -> bool:
    """Whether K-quant `factors` (d_factor, d_super, m_factor, m_super) give d and m
    exactly, for a weight of whole super-blocks."""
    if factors is None or not kquant_fits(d.shape[1] * GROUP):
        return False
    return all(
        torch.equal(factor_values(f, sup), want)
        for f, sup, want in ((factors[0], factors[1], d), (factors[2], factors[3], m))
    )


def compact_scales(
    d: torch.Tensor, m: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group scales of a `bits` weight in the fewest bytes that give them exactly: where
    every d is a power of two and m is -12 d (an MXFP4 file's are), d's exponent bytes alone
    (0.53 bytes a 4-bit weight); else float16 where every one is a float16 value (a Q4_0,
    Q4_1 or Q8_0 file's are), d alone where m is -2^(bits - 1) d (symmetric levels: Q8_0's
    and Q4_0's, 1.0625 bytes an 8-bit weight, 0.5625 a 4-bit one); else as they are. The
    kernels widen them exactly (and make m from d exactly), so the results are the same
    bits. (No m: an empty row for each leading index, so that an expert's m is m[e].)"""
    none = (d.shape[0], 0)
    mantissa, exponent = torch.frexp(d.float())  # d = mantissa * 2^exponent
    e = exponent.to(torch.int32) + 127  # d = 2^(e - 128) where the mantissa is 1/2
    if bool((mantissa == 0.5).all() and ((e >= 0) & (e <= 254)).all()) and torch.equal(
        m.float(), -12 * d.float()
    ):
        return e.to(torch.uint8).view(EXPONENT), torch.empty(none, dtype=EXPONENT)
    d16, m16 = d.half(), m.half()
    if not torch.equal(d16.float(), d):
        return d, m
    if torch.equal(m.float(), -float(1 << (bits - 1)) * d16.float()):
        return d16, torch.empty(none, dtype=torch.float16)
    return (d16, m16) if torch.equal(m16.float(), m) else (d, m)
