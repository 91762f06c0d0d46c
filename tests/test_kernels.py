"""Triton kernels against their torch references (in Triton's interpreter on a CPU): random
block tables with scattered and shared blocks, partial last blocks, contexts from 1 to a few
thousand tokens, decode rows mixed with prompt chunks, GQA ratios 1, 3, 4 and 8.

Tolerances per dtype: fp32 1e-5, fp16 2e-3, bf16 2e-2 (absolute and relative)."""

from __future__ import annotations

import os

import pytest
import torch
import triton  # in the dev extra: a missing triton fails these tests
import triton.language as tl

from lucedesk.kernels.attention_torch import paged_attention_torch, write_kv_torch
from lucedesk.kernels.attention_triton import paged_attention
from lucedesk.kernels.kv_write_triton import write_kv
from lucedesk.kernels.layers_torch import add_rms_norm_torch, rotary_torch
from lucedesk.kernels.layers_triton import add_rms_norm_triton, rotary_triton
from lucedesk.kernels.triton_numerics import interpreting_bf16, round_to_bf16
from tests.kernel_cases import (
    CASES,
    DEVICE,
    LAYER_CASES,
    MULTI_QUERY_CASES,
    ROTARY_CASES,
    TOL,
    WINDOW_CASES,
    int8_caches,
    layer_inputs,
    make_batch,
    multi_query_case,
    one_query_per_position,
    random_sinks,
    rotary_inputs,
)


@pytest.mark.parametrize("ratio,head_dim,dtype,block_size,seqs", CASES)
def test_paged_attention_matches_reference(ratio, head_dim, dtype, block_size, seqs):
    kv_heads = 2
    k_cache, v_cache, meta = make_batch(
        ratio * 7 + head_dim, block_size, seqs, kv_heads, head_dim, dtype
    )
    g = torch.Generator().manual_seed(ratio)
    q = torch.randn(meta.num_tokens, kv_heads * ratio, head_dim, generator=g).to(dtype)
    q = q.to(DEVICE)
    scale = head_dim**-0.5
    got = paged_attention(q, k_cache, v_cache, meta, scale)
    want = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype):
    kv_heads, head_dim, block_size = 3, 64, 16
    k_cache, v_cache, meta = make_batch(
        5, block_size, [(7, 1), (40, 1), (3, 13)], kv_heads, head_dim, dtype
    )
    g = torch.Generator().manual_seed(9)
    # k and v as the model produces them: views into one fused projection output.
    qkv = torch.randn(meta.num_tokens, 3 * kv_heads * head_dim, generator=g).to(dtype)
    k, v = (
        t.view(-1, kv_heads, head_dim) for t in qkv.to(DEVICE).split(kv_heads * head_dim, 1)[1:]
    )
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    write_kv_torch(k, v, ref_k, ref_v, meta.slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_write_kv_matches_reference(dtype):
    """Into an 8-bit cache: the same levels and scales as the torch write (the same fp32
    arithmetic and rounding rule)."""
    kv_heads, head_dim, block_size = 2, 64, 16
    k_cache, _v, meta = make_batch(6, block_size, [(5, 1), (33, 1), (0, 20)], kv_heads, 64, dtype)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(meta.num_tokens, 3 * kv_heads * head_dim, generator=g) * 3
    k, v = (
        t.view(-1, kv_heads, head_dim)
        for t in qkv.to(dtype).to(DEVICE).split(kv_heads * head_dim, 1)[1:]
    )
    k[2, 1] = 0  # an all-zero row
    (kq, vq, ks, vs), _ = int8_caches(k_cache, k_cache)
    ref = [t.clone() for t in (kq, vq, ks, vs)]
    write_kv(k, v, kq, vq, meta.slot_mapping, k_scale=ks, v_scale=vs)
    write_kv_torch(k, v, ref[0], ref[1], meta.slot_mapping, k_scale=ref[2], v_scale=ref[3])
    for got, want in zip((kq, vq, ks, vs), ref):
        assert torch.equal(got, want)


INT8_CASES = [(*c, 0, False) for c in CASES[1::3]] + [c[:7] for c in WINDOW_CASES[1::2]]


@pytest.mark.parametrize("ratio,head_dim,dtype,block_size,seqs,window,sinks", INT8_CASES)
def test_int8_cache_attention_matches_reference(
    ratio, head_dim, dtype, block_size, seqs, window, sinks
):
    """Over an 8-bit cache, what the torch reference computes over the values it holds."""
    kv_heads = 2
    k_cache, v_cache, meta = make_batch(window + head_dim, block_size, seqs, 2, head_dim, dtype)
    g = torch.Generator().manual_seed(window + ratio)
    q = torch.randn(meta.num_tokens, kv_heads * ratio, head_dim, generator=g).to(dtype)
    q = q.to(DEVICE)
    sink = random_sinks(kv_heads * ratio, window) if sinks else None
    (kq, vq, ks, vs), (k_held, v_held) = int8_caches(k_cache, v_cache)
    scale = head_dim**-0.5
    got = paged_attention(q, kq, vq, meta, scale, window, sink, k_scale=ks, v_scale=vs)
    want = paged_attention_torch(q.float(), k_held, v_held, meta, scale, window, sink)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("case", MULTI_QUERY_CASES[1::3])
def test_int8_multi_query_decodes_match_reference(case):
    q, k_cache, v_cache, meta, scale, window, sink = multi_query_case(*case)
    (kq, vq, ks, vs), (k_held, v_held) = int8_caches(k_cache, v_cache)
    got = paged_attention(q, kq, vq, meta, scale, window, sink, k_scale=ks, v_scale=vs)
    want = paged_attention_torch(q.float(), k_held, v_held, meta, scale, window, sink)
    tol = TOL[q.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_wrappers_reject_bad_inputs():
    k_cache, v_cache, meta = make_batch(1, 16, [(3, 1)], 2, 64, torch.float32)
    q = torch.randn(1, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="must be torch.float32"):
        paged_attention(q.half(), k_cache, v_cache, meta, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(q, k_cache.transpose(1, 2), v_cache, meta, 0.1)
    with pytest.raises(ValueError, match="do not group"):
        paged_attention(torch.randn(1, 3, 64, device=DEVICE), k_cache, v_cache, meta, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(torch.randn(1, 4, 48, device=DEVICE), k_cache, v_cache, meta, 0.1)
    with pytest.raises(ValueError, match="rows"):
        paged_attention(torch.randn(2, 4, 64, device=DEVICE), k_cache, v_cache, meta, 0.1)
    small = torch.zeros(2, 4, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="block_size 8"):
        write_kv(
            torch.zeros(1, 2, 64, device=DEVICE),
            torch.zeros(1, 2, 64, device=DEVICE),
            small,
            small,
            meta.slot_mapping,
        )


@pytest.mark.parametrize("float32_weight", [False, True])
@pytest.mark.parametrize("rows,hidden,dtype", LAYER_CASES)
def test_add_rms_norm_matches_reference(rows, hidden, dtype, float32_weight):
    weight_dtype = torch.float32 if float32_weight else None  # multiplied, then rounded
    x, residual, weight = layer_inputs(rows, hidden, dtype, rows, DEVICE, weight_dtype)
    for res in (residual, None):  # the first layer has no residual yet
        normed, new_residual = add_rms_norm_triton(x, res, weight, 1e-5)
        want_normed, want_residual = add_rms_norm_torch(x, res, weight, 1e-5)
        # Within a rounding step, not bit for bit: Triton's interpreter truncates when it
        # narrows float32 to bfloat16, where torch and GPUs round to nearest.
        tol = TOL[dtype]
        torch.testing.assert_close(new_residual.float(), want_residual.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(normed.float(), want_normed.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,dtype", ROTARY_CASES)
def test_rotary_matches_reference_in_place(rows, heads, kv_heads, head_dim, dtype):
    qkv, q, k, cos, sin = rotary_inputs(rows, heads, kv_heads, head_dim, dtype, device=DEVICE)
    want_q, want_k = rotary_torch(q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    got_q, got_k = rotary_triton(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, inside the fused qkv
    tol = TOL[dtype]  # products rounded as torch does, up to the interpreter's bf16 truncation
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


def test_layer_wrappers_reject_bad_inputs():
    x, residual, weight = layer_inputs(4, 64, torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm_triton(x, residual, weight[:32], 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_triton(x, residual.half(), weight, 1e-5)
    _qkv, q, k, cos, sin = rotary_inputs(3, 4, 2, 64, torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_triton(q, k, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="share a dtype"):
        rotary_triton(q, k, cos.half(), sin.half())


@triton.jit
def _round_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, round_to_bf16(tl.load(x_ptr + i)))


def test_the_interpreters_bf16_rounding_is_round_to_nearest_even():
    """The interpreter's bf16 special case rounds as a GPU (and torch) does: every value,
    ties to even included, lands on the same bf16 number."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-30, 30, (4096,), generator=g))
    base = torch.randn(1024, generator=g).bfloat16().float()
    ulp = torch.exp2(torch.floor(torch.log2(base.abs())) - 7)
    ties = base + ulp / 2  # exactly halfway between two bf16 numbers
    edges = torch.tensor([0.0, -0.0, 1.0, 3.0e38, -1.1754944e-38])
    x = torch.cat([x, ties, edges])
    x = torch.cat([x, torch.zeros(triton.next_power_of_2(x.numel()) - x.numel())])
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, x.numel())
    assert torch.equal(y, x.bfloat16().float())


def test_bf16_runs_the_emulated_path_only_in_the_interpreter(monkeypatch):
    assert interpreting_bf16(torch.bfloat16) == (os.environ.get("TRITON_INTERPRET") == "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreting_bf16(torch.bfloat16)
    assert not interpreting_bf16(torch.float16) and not interpreting_bf16(torch.float32)


@pytest.mark.parametrize("ratio,head_dim,dtype,block_size,seqs,window,sinks", WINDOW_CASES)
def test_windows_and_sinks_match_reference(ratio, head_dim, dtype, block_size, seqs, window, sinks):
    kv_heads = 2
    k_cache, v_cache, meta = make_batch(
        window + head_dim, block_size, seqs, kv_heads, head_dim, dtype
    )
    g = torch.Generator().manual_seed(window)
    q = torch.randn(meta.num_tokens, kv_heads * ratio, head_dim, generator=g).to(dtype).to(DEVICE)
    sink = random_sinks(kv_heads * ratio, window) if sinks else None
    scale = head_dim**-0.5
    got = paged_attention(q, k_cache, v_cache, meta, scale, window, sink)
    want = paged_attention_torch(
        q.float(), k_cache.float(), v_cache.float(), meta, scale, window, sink
    )
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("case", MULTI_QUERY_CASES)
def test_multi_query_decodes_match_reference(case):
    """A drafted decode's rows tiled together, each masked at its own causal end (and window
    start), against the reference; and against the same rows as one-query decodes."""
    q, k_cache, v_cache, meta, scale, window, sink = multi_query_case(*case)
    got = paged_attention(q, k_cache, v_cache, meta, scale, window, sink)
    f32 = [t.float() for t in (q, k_cache, v_cache)]
    want = paged_attention_torch(*f32, meta, scale, window, sink)
    tol = TOL[q.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    apart_meta = one_query_per_position(meta, k_cache.shape[2])
    apart = paged_attention(q, k_cache, v_cache, apart_meta, scale, window, sink)
    torch.testing.assert_close(got.float(), apart.float(), atol=tol, rtol=tol)
