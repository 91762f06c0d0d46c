"""The KV write as a Triton kernel: each new token's K and V rows to their slots in the
cache, one program per (token, KV head); into an 8-bit cache each row is quantized on the
way (one float32 scale per token and KV head, kv_storage.py), from that row alone."""

from __future__ import annotations

import triton
import triton.language as tl

from lucedesk.kernels.attention_triton import _check, _check_cache, _check_rows
from lucedesk.kernels.kv_storage import check_scales


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cache_rows,
    HEAD_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    # k/v rows may be views into the fused qkv output: addressed through their strides.
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    dst = (head.to(tl.int64) * cache_rows + slot) * HEAD_DIM + d
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + d)
    v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + d)
    if QUANTIZED:
        scale_dst = head.to(tl.int64) * cache_rows + slot
        _store_levels(k, k_cache_ptr + dst, k_scale_ptr + scale_dst)
        _store_levels(v, v_cache_ptr + dst, v_scale_ptr + scale_dst)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def _store_levels(x, dst, scale_dst):
    """One row at 8 bits, as kv_storage.quantize_rows: max|x| -> 127, floor(y + 0.5)."""
    xf = x.to(tl.float32)
    scale = tl.max(tl.abs(xf), 0) / 127.0
    safe = tl.where(scale > 0, scale, 1.0)
    levels = tl.minimum(tl.maximum(tl.floor(xf / safe + 0.5), -127.0), 127.0)
    tl.store(dst, levels.to(tl.int8))
    tl.store(scale_dst, scale)


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] scattered to their slots in the cache; an int8
    cache gets each row's levels and its scale."""
    check_scales(k_cache, v_cache, k_scale, v_scale)
    _check_rows("k", k)
    _check_rows("v", v)
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    _check_cache(k, k_cache, v_cache)
    _check("slot_mapping", slot_mapping, 1)
    if k.shape[1] != k_cache.shape[0] or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"k {tuple(k.shape)}, slot_mapping {tuple(slot_mapping.shape)} and "
            f"cache {tuple(k_cache.shape)} do not agree"
        )
    if k.shape[0] == 0:
        return
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    _write_kv_kernel[(k.shape[0], kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        num_blocks * block_size,
        HEAD_DIM=head_dim,
        QUANTIZED=k_scale is not None,
    )
