"""A weight's levels and scales as the low-bit kernels lay them out (csrc/lowbit.h), and
back: any weight quantized to 8-bit levels per group of 32 inputs (`quantize_groups`), the
levels packed at 4, 6 or 8 bits (`pack_codes`), the values they stand for (`affine`,
`six_bit_values`)."""

from __future__ import annotations

import torch

from lucedesk.kernels.checks import require
from lucedesk.kernels.scales import (
    GROUP,
    channel_blocks,
    factor_values,
    held_rows,
    kquant_fits,
    six_bit_rows,
    six_bit_scales,
)

ROWS_AT_ONCE = 4096  # bounds the float copies while quantizing a big LM head


def fits(shape: tuple[int, ...]) -> bool:
    """Whether a [N, K] weight takes the fast layouts: whole groups, whole 16-channel blocks."""
    n, k = shape[-2:]
    return k % GROUP == 0 and n % 16 == 0


def quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """groups: [..., 32] float32 -> (q int8, d, m) with groups ~= d * q + m.

    Three grids are tried per group and the closest kept: min..max over all 256 levels
    (exact for Q4_1/Q4_K groups, whose extremes are levels 0 and 15), +-max|w| over
    +-127 (exact for Q8_0), and the max-magnitude value at level -128 (exact for Q4_0,
    whose scale puts it at -8 of 16 levels)."""
    low, high = groups.amin(-1), groups.amax(-1)
    peak = torch.where(high.abs() >= low.abs(), high, low)  # signed value of largest magnitude
    tiny = torch.finfo(torch.float32).tiny
    d_affine = ((high - low) / 255).clamp(min=tiny)
    candidates = [
        (d_affine, low + 128 * d_affine),
        ((peak.abs() / 127).clamp(min=tiny), torch.zeros_like(low)),
        (
            torch.where(peak < 0, 1.0, -1.0) * (peak.abs() / 128).clamp(min=tiny),
            torch.zeros_like(low),
        ),
    ]
    best = None
    for d, m in candidates:
        q = torch.round((groups - m[..., None]) / d[..., None]).clamp(-128, 127)
        err = (q * d[..., None] + m[..., None] - groups).abs().amax(-1)
        if best is None:
            best = [q, d, m, err]
        else:
            better = err < best[3]
            best = [
                torch.where(better[..., None], q, best[0]),
                torch.where(better, d, best[1]),
                torch.where(better, m, best[2]),
                torch.minimum(err, best[3]),
            ]
    return best[0].to(torch.int8), best[1], best[2]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Any [N, K] weight -> (q int8 [N, K / 32, 32], d and m float32 [N, K / 32]) by
    `quantize_groups`, a bounded number of rows at a time."""
    n, k = weight.shape
    require(k % GROUP == 0, f"quantized weights need inputs in groups of 32, got {k}")
    parts = [
        quantize_groups(rows.float().view(-1, k // GROUP, GROUP))
        for rows in weight.detach().split(ROWS_AT_ONCE)
    ]
    q, d, m = (torch.cat(t) for t in zip(*parts))
    return q, d, m


def eight_bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Any [N, K] weight as 8-bit (levels uint8 [N, K], d, m) (see `quantize_groups`)."""
    q, d, m = quantize_rows(weight)
    levels = (q.to(torch.int16) + 128).to(torch.uint8).view(weight.shape)
    return levels, d, m - 128 * d


def affine(levels: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """levels [N, K], d and m [N, K / 32] -> [N, K] float32 d * level + m."""
    n, k = levels.shape
    return (levels.float().view(n, -1, GROUP) * d[..., None] + m[..., None]).view(n, k)


def pack_codes(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """levels uint8 [N, K] below 2**bits -> the low-bit kernels' q [N/16, K/32, 64 * bits]."""
    n, k = levels.shape
    require(bits in (4, 6, 8), f"bits must be 4, 6 or 8, got {bits}")
    require(fits((n, k)), f"low-bit weights need N % 16 == 0 and K % 32 == 0, got {n}x{k}")
    require(levels.dtype == torch.uint8, f"levels must be uint8, got {levels.dtype}")
    top = int(levels.max()) if levels.numel() else 0
    require(top < 2**bits, f"{bits}-bit levels exceed {2**bits - 1}")
    # [N/16, 16 channels, K/32, 8 quads, 4] -> [N/16, K/32, 8 quads, 16 channels, 4]
    v = levels.view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, 512)
    packed = v
    if bits < 8:  # value p in byte p's low nibble, value p + 256 in its high one
        low = v & 0x0F
        packed = low[:, :256] | (low[:, 256:] << 4)
    if bits == 6:  # then byte p the high bit pairs of values p, p + 128, p + 256, p + 384
        high = v >> 4
        pairs = high[:, :128] | high[:, 128:256] << 2 | high[:, 256:384] << 4 | high[:, 384:] << 6
        packed = torch.cat([packed, pairs], 1)
    return packed.reshape(n // 16, k // 32, 64 * bits).contiguous()


def pack_levels(
    levels: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """levels uint8 [N, K] (below 2**bits), d and m float32 [N, K / 32] -> the low-bit
    kernels' layout: q [N/16, K/32, 64 * bits], d and m [N/16, K/32, 16]."""
    n, k = levels.shape
    require(bits in (4, 8), f"bits must be 4 or 8 for scales per 32 inputs, got {bits}")
    require(
        tuple(d.shape) == tuple(m.shape) == (n, k // GROUP),
        f"group scales must be [{n}, {k // GROUP}], got {tuple(d.shape)}",
    )
    return pack_codes(levels, bits), channel_blocks(d), channel_blocks(m)


def six_bit_held(
    d: torch.Tensor, m: torch.Tensor, factors: tuple[torch.Tensor, ...] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A 6-bit weight's d and m per sixteen inputs [N, K / 16] with their factors (int8
    [N, K / 16], float32 super scales [N, K / 256]) -> the kernels' scales and (empty) m,
    where the factors give d exactly and m is -32 d (Q6_K's are and it is)."""
    require(factors is not None and len(factors) == 2, "6-bit weights need their factors")
    factor, super_ = factors
    require(kquant_fits(factor.shape[1] * 16), "6-bit weights need K % 256 == 0")
    exact = factor_values(factor, super_)
    require(torch.equal(exact, d) and torch.equal(m, -32 * d), "6-bit factors differ from d")
    return six_bit_scales(factor, super_), torch.empty(0, dtype=torch.int8)


def six_bit_values(levels: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """levels [N, K] and d [N, K / 16] -> [N, K] float32 d * (level - 32)."""
    n, k = levels.shape
    return ((levels.float() - 32).view(n, -1, 16) * d[..., None]).view(n, k)


def held_values(levels: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """`bits` levels [N, K] with their scales as the kernels hold them (a 6-bit weight's
    int8 ones included) -> the [N, K] float32 values they stand for."""
    k = levels.shape[1]
    if d.dtype == torch.int8:
        return six_bit_values(levels, six_bit_rows(d, k))
    return affine(levels, *held_rows(d, m, k, bits))


def unpack_levels(
    q: torch.Tensor, bits: int, n: int, k: int, lut: torch.Tensor | None = None
) -> torch.Tensor:
    """The levels back in [N, K] order (the stored codes looked up where there is a
    table)."""
    v = torch.cat([q & 0x0F, q >> 4], dim=-1) if bits == 4 else q
    if bits == 6:
        low, h = torch.cat([q[..., :256] & 0x0F, q[..., :256] >> 4], -1), q[..., 256:]
        v = low | torch.cat([h & 3, h >> 2 & 3, h >> 4 & 3, h >> 6], -1) << 4
    codes = v.reshape(n // 16, k // 32, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
    return codes if lut is None else lut[codes.long()]
