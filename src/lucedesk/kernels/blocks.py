"""A GGUF tensor's blocks as the Triton kernels hold them: the file's bits reordered into
planes the kernels read aligned, never widened, and the torch reference that reads them back
(bit for bit the values llama.cpp's definitions give).

A [N, K] weight of any held type is six planes, each with N rows (so fusing weights or
undoing a row permutation is a row operation on every plane):

    codes         uint8 [N, K/2]: value k's low four bits in byte k // 2, its low nibble for
                  even k (Q8_0: int8 [N, K], the values themselves)
    high          the bits above four: uint8 [N, K/8], value k's fifth bit as bit k % 8 of
                  byte k // 8 (Q5_0, Q5_1, Q5_K), or [N, K/4], its fifth and sixth as bits
                  2 (k % 4) of byte k // 4 (Q6_K); else [N, 0]
    scale         one per group of 32 values: float16 d (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
                  IQ4_NL), uint8 (a K-quant's 6-bit scale factor; MXFP4's exponent), int8
                  (IQ4_XS's scale less 32); Q6_K: int8 factors per sixteen values
    offset        one per group: float16 m (Q4_1, Q5_1), uint8 (a K-quant's min factor); else
                  [N, 0]
    super_scale   float16 per 256 values (Q4_K, Q5_K, Q6_K, IQ4_XS's d); else [N, 0]
    super_offset  float16 per 256 values (Q4_K's and Q5_K's dmin); else [N, 0]

and a value is (q its level, lut the 16-entry non-linear table):

    Q4_0  d (q - 8)      Q4_1  d q + m        Q5_0  d (q - 16)     Q5_1  d q + m
    Q8_0  d q            Q4_K, Q5_K  (D sc) q - (Dmin mn)         Q6_K  (D sc) (q - 32)
    MXFP4  2^(e - 128) e2m1(q), doubled       IQ4_NL  d lut[q]     IQ4_XS  (D ls) lut[q]

Any other weight is held as Q8_0 blocks of its values (`q8_0_planes`, llama.cpp's own
rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# MXFP4's e2m1 codes, doubled (llama.cpp's kvalues_mxfp4), and IQ4's non-linear levels.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The kernels' number for each type (a constexpr of theirs).
KINDS = {
    t: i
    for i, t in enumerate(
        ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_NL",
         "IQ4_XS")
    )
}  # fmt: skip
SUPER = 256


class Planes(NamedTuple):
    """One [N, K] weight of GGUF type `kind` (see the module's top)."""

    kind: str
    codes: torch.Tensor
    high: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    super_scale: torch.Tensor
    super_offset: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.codes.shape
        return n, width if self.kind == "Q8_0" else 2 * width

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self[1:])

    def rows(self, index: torch.Tensor) -> Planes:
        """The planes of these rows, in this order."""
        return Planes(self.kind, *(t[index] for t in self[1:]))

    def to(self, device: torch.device | str) -> Planes:
        return Planes(self.kind, *(t.to(device) for t in self[1:]))

    @staticmethod
    def cat(parts: list[Planes]) -> Planes:
        """Weights of one type stacked along N."""
        return Planes(parts[0].kind, *(torch.cat(ts) for ts in zip(*(p[1:] for p in parts))))


def _half(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Blocks of 16 bytes, value j in byte j's low nibble and value j + 16 in its high one
    (Q4_0's order) -> levels [..., 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _pack(levels: np.ndarray, n: int, k: int) -> np.ndarray:
    """Levels [N, K] (below 16 in their low four bits) -> codes [N, K / 2]."""
    low = levels.reshape(n, k) & 0x0F
    return low[:, 0::2] | (low[:, 1::2] << 4)


def _high(levels: np.ndarray, n: int, k: int, bits: int) -> np.ndarray:
    """The bits above four of levels [N, K] -> high [N, K / 8] (5 bits) or [N, K / 4] (6)."""
    top = levels.reshape(n, k) >> 4
    if bits == 5:
        return np.packbits(top, axis=1, bitorder="little")
    return top[:, 0::4] | top[:, 1::4] << 2 | top[:, 2::4] << 4 | top[:, 3::4] << 6


def q6_k_levels(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K blocks [B, 210] -> levels uint8 [B * 256] in 0..63 in value order (as llama.cpp
    orders them), factors int8 [B, 16] (one per sixteen values) and d float16 [B, 1]: value
    = d * factor * (level - 32)."""
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts
    levels = (ql & 0x0F).reshape(-1, 256) | ((qh & 0x03).reshape(-1, 256) << 4)
    factor = blocks[:, 192:208].copy().view(np.int8)
    return levels.reshape(-1), factor, _half(blocks[:, 208:210])


def iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks [B, 136] -> each group's scale less 32, int8 [B, 8] (a group of 32
    values is d * scale * table[code])."""
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)  # [B, 1]
    low = (blocks[:, 4:8, None] >> np.array([0, 4], np.uint8)).reshape(-1, 8) & 0x0F
    top = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [B, 8]
    return ((low | (top.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.int8)


def planes_from_blocks(raw: np.ndarray, kind: str, n: int, k: int) -> Planes:
    """A [N, K] tensor's bytes in GGUF type `kind` (rows of blocks along K) -> its planes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # llama.cpp's block sizes

    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    b = np.asarray(raw, np.uint8).reshape(n, k // values, size)
    none = np.zeros((n, 0), np.uint8)
    codes, high, offset, sup, sup_off = None, none, none, none, none
    if kind in ("Q4_0", "IQ4_NL"):
        scale, codes = _half(b[..., 0:2]), _pack(_nibbles(b[..., 2:18]), n, k)
    elif kind in ("Q4_1", "Q5_1", "Q5_0"):
        first = 4 if kind != "Q5_0" else 2
        scale = _half(b[..., 0:2])
        if kind != "Q5_0":
            offset = _half(b[..., 2:4])
        qs = b[..., first + 4 * (kind != "Q4_1") :]
        levels = _nibbles(qs)
        if kind != "Q4_1":  # bit j of a little-endian uint32: value j's fifth
            bits = np.unpackbits(b[..., first : first + 4], axis=-1, bitorder="little")
            levels = levels | (bits << 4)
            high = _high(levels, n, k, 5)
        codes = _pack(levels, n, k)
    elif kind == "Q8_0":
        scale, codes = _half(b[..., 0:2]), np.ascontiguousarray(b[..., 2:]).view(np.int8)
    elif kind in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        sup, sup_off = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12).copy())
        scale, offset = sc.reshape(n, -1), mn.reshape(n, -1)
        qs = b[..., -128:].reshape(n, -1, 4, 1, 32)  # pairs of groups: low nibbles first
        levels = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if kind == "Q5_K":  # group g's fifth bits: bit g of each of 32 bytes
            qh = b[..., 16:48].reshape(n, -1, 1, 32)
            levels = levels | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
            high = _high(levels, n, k, 5)
        codes = _pack(levels, n, k)
    elif kind == "Q6_K":
        levels, factor, sup = q6_k_levels(b.reshape(-1, size))
        codes, high, scale = _pack(levels, n, k), _high(levels, n, k, 6), factor.reshape(n, -1)
    elif kind == "MXFP4":
        scale, codes = b[..., 0], _pack(_nibbles(b[..., 1:17]), n, k)
    elif kind == "IQ4_XS":
        sup, scale = _half(b[..., 0:2]), iq4_xs_scales(b.reshape(-1, size))
        codes = _pack(_nibbles(b[..., 8:].reshape(n, -1, 8, 16)), n, k)
    else:
        raise ValueError(f"{kind} blocks are not held by the Triton kernels")
    arrays = (codes, high, scale, offset, sup, sup_off)
    return Planes(kind, *(torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1)) for a in arrays))


def q8_0_planes(weight: torch.Tensor) -> Planes:
    """Any [N, K] weight (K a multiple of 32) as Q8_0 blocks, rounded as llama.cpp does."""
    from gguf import GGMLQuantizationType, quants

    n, k = weight.shape
    raw = quants.quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)
    return planes_from_blocks(raw, "Q8_0", n, k)


def _groups(plane: torch.Tensor, k: int) -> torch.Tensor:
    """One value a group (of K / plane's width values) -> one a value, float32 [N, K]."""
    return plane.float().repeat_interleave(k // plane.shape[1], dim=1)


def levels_of(p: Planes) -> torch.Tensor:
    """Every value's level (code and high bits) as int32 [N, K] (Q8_0's signed values)."""
    n, k = p.shape
    if p.kind == "Q8_0":
        return p.codes.to(torch.int32)
    codes = p.codes.to(torch.int32)
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, k)
    if p.high.shape[1]:
        per = k // p.high.shape[1]  # values a byte: 8 (one bit each) or 4 (two)
        width = 8 // per
        shifts = torch.arange(per, dtype=torch.int32) * width
        bits = (p.high.to(torch.int32)[..., None] >> shifts) & ((1 << width) - 1)
        q = q | (bits.reshape(n, k) << 4)
    return q


def dequantize_planes(p: Planes) -> torch.Tensor:
    """The values [N, K] float32 the planes hold, computed as llama.cpp's definitions (and
    the gguf package's decoders) compute them, to the bit."""
    n, k = p.shape
    q = levels_of(p).float()
    if p.kind in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
        d = _groups(p.super_scale, k) * _groups(p.scale, k)
    elif p.kind == "MXFP4":  # 2^(e - 128), exactly
        d = torch.ldexp(torch.ones(n, k), _groups(p.scale, k) - 128)
    else:
        d = _groups(p.scale, k)
    if p.kind in ("Q4_K", "Q5_K"):
        return q * d - _groups(p.super_offset, k) * _groups(p.offset, k)
    if p.kind in ("Q4_1", "Q5_1"):
        return d * q + _groups(p.offset, k)
    if p.kind in ("MXFP4", "IQ4_NL", "IQ4_XS"):
        table = torch.tensor(MXFP4_VALUES if p.kind == "MXFP4" else IQ4_VALUES).float()
        return d * table[q.long()]
    offset = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q8_0": 0}[p.kind]
    return d * (q - offset)
