"""Matmuls over GGUF blocks as Triton kernels (GPUs: CUDA, and ROCm unchanged): x [M, K]
times a weight held as planes (kernels/blocks.py), each weight tile dequantized in registers
and fed to `tl.dot` in the activations' dtype (bf16: each product exact, summed in fp32).

One kernel serves every shape the engine runs:

- decode rows (M <= 16): one tile of 16 rows, so each weight is read once for all of them;
  where N alone gives few programs, K is split over SPLITS programs (set by N and K, never
  by M) whose partial sums a second kernel adds in order: no atomics, so a row's result
  never depends on its batch;
- prompt rows: tiles of 64 rows;
- a mixture's (row, expert) pairs, sorted by expert and cut into tiles of one expert's rows
  (moe_triton.tile_table), the expert's planes addressed as rows e * N .. e * N + N - 1;
- gate|up with its activation (GATED): each program computes gate columns c and up columns
  c + N / 2 from the same x tile and writes act(gate) * up, rounded where the separate ops
  would round (the halves to the dtype, the activation, the product).

The embedding table's rows are read from its blocks the same way (`block_rows`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BK = 32  # inputs a step: one group of every held type
# Activations a GATED launch applies (the families' hidden_act).
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2, "swiglu_clamped": 3}


@triton.jit
def _expand(v, BN: tl.constexpr, GROUPS: tl.constexpr, WIDTH: tl.constexpr):
    """[BN, GROUPS] -> [BN, GROUPS * WIDTH]: each group's value for each of its values."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BN, GROUPS, WIDTH)), (BN, GROUPS * WIDTH))


@triton.jit
def _dequant_tile(
    codes_ptr, high_ptr, scale_ptr, offset_ptr, sscale_ptr, soffset_ptr, lut_ptr,
    row0, rows, row_ok, k0, K,
    KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Weight rows row0 + `rows` (row0 a scalar int64, rows [BN] int32 from 0), inputs k0 ..
    k0 + BK (BK divides 256; inputs past K read as zeros) -> the values they hold, float32
    [BN, BK] (blocks.dequantize_planes' arithmetic). Each plane is addressed from its row0's
    start with 32-bit offsets: 64-bit ones for every value of a tile took registers enough
    to spill on the AMD targets."""
    G: tl.constexpr = BK // 32
    mask = row_ok[:, None]
    g = k0 // 32 + tl.arange(0, G)
    in_k = mask & (g < K // 32)[None, :]  # this tile's groups within K
    if KIND == 4:  # Q8_0: the values themselves
        kk = k0 + tl.arange(0, BK)
        ok = mask & (kk < K)[None, :]
        q = tl.load(codes_ptr + row0 * K + rows[:, None] * K + kk[None, :], mask=ok, other=0)
        q = q.to(tl.int32)
    else:
        hk = k0 // 2 + tl.arange(0, BK // 2)
        base = codes_ptr + row0 * (K // 2)
        ok = mask & (hk < K // 2)[None, :]
        b = tl.load(base + rows[:, None] * (K // 2) + hk[None, :], mask=ok, other=0)
        b = b.to(tl.int32)
        q = tl.reshape(tl.join(b & 15, b >> 4), (BN, BK))
        if KIND == 2 or KIND == 3 or KIND == 6:  # Q5_0, Q5_1, Q5_K: a fifth bit each
            hk = k0 // 8 + tl.arange(0, BK // 8)
            base = high_ptr + row0 * (K // 8)
            ok = mask & (hk < K // 8)[None, :]
            h = tl.load(base + rows[:, None] * (K // 8) + hk[None, :], mask=ok, other=0)
            bits = (h.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
            q = q | (tl.reshape(bits, (BN, BK)) << 4)
        if KIND == 7:  # Q6_K: two high bits each
            hk = k0 // 4 + tl.arange(0, BK // 4)
            base = high_ptr + row0 * (K // 4)
            ok = mask & (hk < K // 4)[None, :]
            h = tl.load(base + rows[:, None] * (K // 4) + hk[None, :], mask=ok, other=0)
            bits = (h.to(tl.int32)[:, :, None] >> (2 * tl.arange(0, 4))[None, None, :]) & 3
            q = q | (tl.reshape(bits, (BN, BK)) << 4)
    if KIND == 7:  # Q6_K: an int8 factor per sixteen values
        g16 = k0 // 16 + tl.arange(0, BK // 16)
        base = scale_ptr + row0 * (K // 16)
        ok = mask & (g16 < K // 16)[None, :]
        f = tl.load(base + rows[:, None] * (K // 16) + g16[None, :], mask=ok, other=0)
        scale = _expand(f.to(tl.float32), BN, BK // 16, 16)
    else:
        base = scale_ptr + row0 * (K // 32)
        f = tl.load(base + rows[:, None] * (K // 32) + g[None, :], mask=in_k, other=0)
        if KIND == 8:  # MXFP4: d = 2^(e - 128), built from its bits (e8m0 as llama.cpp reads it)
            e = f.to(tl.int32)
            bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
            scale = _expand(bits.to(tl.float32, bitcast=True), BN, G, 32)
        else:
            scale = _expand(f.to(tl.float32), BN, G, 32)
    if KIND == 5 or KIND == 6 or KIND == 7 or KIND == 10:  # a super-block's d times the factor
        s = k0 // 256
        base = sscale_ptr + row0 * (K // 256) + s
        sd = tl.load(base + rows * (K // 256), mask=row_ok, other=0).to(tl.float32)
        scale = sd[:, None] * scale
    qf = q.to(tl.float32)
    if KIND == 0:
        w = scale * (qf - 8.0)
    elif KIND == 1 or KIND == 3:  # Q4_1, Q5_1: d q + m
        base = offset_ptr + row0 * (K // 32)
        m = tl.load(base + rows[:, None] * (K // 32) + g[None, :], mask=in_k, other=0)
        w = scale * qf + _expand(m.to(tl.float32), BN, G, 32)
    elif KIND == 2:
        w = scale * (qf - 16.0)
    elif KIND == 4:
        w = scale * qf
    elif KIND == 5 or KIND == 6:  # Q4_K, Q5_K: (D sc) q - (Dmin mn)
        base = offset_ptr + row0 * (K // 32)
        mn = tl.load(base + rows[:, None] * (K // 32) + g[None, :], mask=in_k, other=0)
        base = soffset_ptr + row0 * (K // 256) + s
        dmin = tl.load(base + rows * (K // 256), mask=row_ok, other=0).to(tl.float32)
        w = qf * scale - dmin[:, None] * _expand(mn.to(tl.float32), BN, G, 32)
    elif KIND == 7:
        w = scale * (qf - 32.0)
    elif KIND == 8:  # e2m1 codes, doubled: 0 1 2 3 4 6 8 12, the sign in bit 3
        c = q & 7
        shift = tl.maximum((c >> 1) - 1, 0)
        mag = tl.where(c < 4, c, (2 + (c & 1)) << shift)
        w = scale * tl.where((q & 8) != 0, -mag, mag).to(tl.float32)
    else:  # IQ4_NL, IQ4_XS: the non-linear table
        w = scale * tl.load(lut_ptr + q)
    return w


@triton.jit
def _rounded(x, ROUND: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """x rounded to the output dtype, kept in float32 (ROUND 1: bf16 in the interpreter,
    which narrows by truncation; see triton_numerics.interpreting_bf16)."""
    if ROUND == 1:  # round_to_bf16, written out (a nested call costs the interpreter ms)
        bits = x.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _activate(g, u, ACT: tl.constexpr, limit, alpha, ROUND: tl.constexpr, OUT: tl.constexpr):
    g = _rounded(g, ROUND, OUT)
    u = _rounded(u, ROUND, OUT)
    if ACT == 1:  # SiLU(gate) * up
        a = _rounded(g * tl.sigmoid(g), ROUND, OUT)
        return a * u
    if ACT == 2:  # GELU(gate, tanh) * up: tanh(z) = 2 sigmoid(2 z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = _rounded(0.5 * g * (2.0 * tl.sigmoid(2.0 * z)), ROUND, OUT)
        return a * u
    g = tl.minimum(g, limit)  # gpt-oss: both clamped, up shifted by one
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return (u + 1.0) * (g * tl.sigmoid(g * alpha))


@triton.jit
def _block_matmul_kernel(
    x_ptr, out_ptr, part_ptr,
    codes_ptr, high_ptr, scale_ptr, offset_ptr, sscale_ptr, soffset_ptr, lut_ptr, bias_ptr,
    tile_expert_ptr, tile_row_ptr, tile_stop_ptr, num_tiles_ptr,
    M, N, K, x_stride, out_stride, out_col0, k_per_split, limit, alpha,
    KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPLITS: tl.constexpr, GROUPED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if GROUPED:
        if pid_m >= tl.load(num_tiles_ptr):
            return
        expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        row0 = tl.load(tile_row_ptr + pid_m).to(tl.int64)
        stop = tl.load(tile_stop_ptr + pid_m).to(tl.int64)
    else:
        expert = 0
        row0 = pid_m.to(tl.int64) * BM
        stop = M
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < stop
    n_out = N // 2 if ACT else N
    col0 = tl.program_id(1) * BN
    local = tl.arange(0, BN)
    cols = col0 + local
    col_ok = cols < n_out
    # This tile's first weight row (its gate half's, gated), in 64 bits: a held LM head's
    # row times its bytes can pass 2^31.
    wrow0 = expert * N + col0.to(tl.int64)
    split = tl.program_id(2)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    for k0 in range(k_begin, k_end, BK):
        kk = k0 + tl.arange(0, BK)
        x_ok = row_ok[:, None] & (kk < k_end)[None, :]
        xs = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=x_ok, other=0)
        xs = xs.to(DOT_DTYPE)
        w = _dequant_tile(
            codes_ptr, high_ptr, scale_ptr, offset_ptr, sscale_ptr, soffset_ptr, lut_ptr,
            wrow0, local, col_ok, k0, K, KIND, BN, BK,
        )  # fmt: skip
        w = (_rounded(w, ROUND, OUT) if ROUND else w).to(DOT_DTYPE)
        acc += tl.dot(xs, tl.trans(w), input_precision="ieee")
        if ACT:
            w = _dequant_tile(
                codes_ptr, high_ptr, scale_ptr, offset_ptr, sscale_ptr, soffset_ptr, lut_ptr,
                wrow0 + n_out, local, col_ok, k0, K, KIND, BN, BK,
            )  # fmt: skip
            w = (_rounded(w, ROUND, OUT) if ROUND else w).to(DOT_DTYPE)
            acc_up += tl.dot(xs, tl.trans(w), input_precision="ieee")
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLITS > 1:  # partial sums, added in order by _sum_splits_kernel
        part = part_ptr + (split * M + rows[:, None]) * N + cols[None, :]
        tl.store(part, acc, mask=ok)
        return
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + cols, mask=col_ok, other=0).to(tl.float32)[None, :]
        if ACT:
            up_bias = tl.load(bias_ptr + expert * N + n_out + cols, mask=col_ok, other=0)
            acc_up += up_bias.to(tl.float32)[None, :]
    if ACT:
        acc = _activate(acc, acc_up, ACT, limit, alpha, ROUND, OUT)
    if ROUND:
        acc = _rounded(acc, ROUND, OUT)
    out = out_ptr + rows[:, None] * out_stride + out_col0 + cols[None, :]
    tl.store(out, acc.to(OUT), mask=ok)


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, M, N, out_stride, out_col0,
    SPLITS: tl.constexpr, BN: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = cols < N
    acc = tl.zeros([BN], tl.float32)
    for s in range(SPLITS):  # in order: the same sum whatever else is in the batch
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    if ROUND:
        acc = _rounded(acc, ROUND, OUT)
    tl.store(out_ptr + row * out_stride + out_col0 + cols, acc.to(OUT), mask=ok)


@triton.jit
def _block_rows_kernel(
    ids_ptr, out_ptr,
    codes_ptr, high_ptr, scale_ptr, offset_ptr, sscale_ptr, soffset_ptr, lut_ptr,
    K, KIND: tl.constexpr, BK: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    row = tl.load(ids_ptr + token).to(tl.int64)
    first = tl.arange(0, 1)  # [1]: one row
    w = _dequant_tile(
        codes_ptr, high_ptr, scale_ptr, offset_ptr, sscale_ptr, soffset_ptr, lut_ptr,
        row, first, first == 0, k0, K, KIND, 1, BK,
    )  # fmt: skip
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    if ROUND:
        w = _rounded(w, ROUND, OUT)
    kk = k0 + tl.arange(0, BK)
    tl.store(out_ptr + token * K + kk[None, :], w.to(OUT))


class Tiles(NamedTuple):
    """A launch's tile shape, how many programs split K, and its warps."""

    bm: int
    bn: int
    bk: int
    splits: int
    warps: int = 4


def interpreting(interpret: bool | None = None) -> bool:
    """Whether kernels run in Triton's interpreter (`interpret` None: TRITON_INTERPRET
    says; False: as on a GPU, what compile_targets compiles)."""
    return os.environ.get("TRITON_INTERPRET") == "1" if interpret is None else interpret


def tiles_for(
    m: int,
    n: int,
    k: int,
    grouped: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    interpret: bool | None = None,
) -> Tiles:
    """The tiles a launch takes: 16 rows x 32 columns for decode (and a mixture's pairs, a
    few to an expert), 64 x 64 on eight warps for prompts, 16 x 16 in fp32, 32 inputs a
    step: the largest that compile without spills on gfx1201 and gfx1151 for every held
    type, gated or not (bench/compile_targets.py). K is split where N gives fewer than 128
    programs (a decode's bandwidth needs a few programs per compute unit), never by M. In
    Triton's interpreter, which runs each program in Python, tiles of up to 4,096 outputs
    and 256 inputs and no split (the same kernel: tests run the GPU's tiles there too)."""
    if dtype == torch.float32:
        bm, bn, warps = 16, 16, 4
    elif grouped or m <= 16:
        bm, bn, warps = 16, 32, 4
    else:
        bm, bn, warps = 64, 64, 8
    bk, interpreted = BK, interpreting(interpret)
    if interpreted:  # few programs, wide steps, no split: each costs Python, not size
        bn = min(4096, triton.next_power_of_2(n))
        bk = min(256, triton.next_power_of_2(k))
    splits = 1
    if not grouped and m <= 16 and not interpreted:
        programs = triton.cdiv(n, bn)
        while programs * splits < 128 and k // (splits * 2) >= 4 * bk:
            splits *= 2
    return Tiles(bm, bn, bk, splits, warps)
