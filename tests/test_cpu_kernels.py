"""The C++ CPU kernels against their torch references: paged decode attention over random,
scattered and shared blocks (with prompt chunks in the same step taking the torch path),
residual-add + RMSNorm and rotary in every dtype; and the wrappers' checks.

Tolerances per dtype as in kernel_cases.TOL; rotary and the residual add round exactly
where torch does, so they are compared bit for bit."""

from __future__ import annotations

import pytest
import torch

from lucedesk.kernels.attention_torch import paged_attention_torch
from lucedesk.kernels.cpu import add_rms_norm_cpu, paged_attention_cpu, rotary_cpu
from lucedesk.kernels.layers_torch import add_rms_norm_torch, rotary_torch
from tests.kernel_cases import (
    CASES,
    LAYER_CASES,
    ROTARY_CASES,
    TOL,
    layer_inputs,
    make_batch,
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
    scale = head_dim**-0.5
    got = paged_attention_cpu(q, k_cache, v_cache, meta, scale)
    want = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_rows_do_not_depend_on_the_batch():
    """A sequence's output is the same alone or among others, bit for bit."""
    seqs = [(300, 1), (17, 1), (1000, 1), (64, 1)]
    k_cache, v_cache, meta = make_batch(3, 16, seqs, 3, 64, torch.bfloat16)
    q = torch.randn(len(seqs), 9, 64).bfloat16()
    together = paged_attention_cpu(q, k_cache, v_cache, meta, 0.125)
    for i in range(len(seqs)):
        _k, _v, alone_meta = make_batch(3, 16, seqs, 3, 64, torch.bfloat16)
        alone_meta = type(meta).build(
            [1], [meta.seq_lens_cpu[i]], [meta.block_tables[i].tolist()], 16, 1
        )
        alone = paged_attention_cpu(q[i : i + 1], k_cache, v_cache, alone_meta, 0.125)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("rows,hidden,dtype", LAYER_CASES)
def test_add_rms_norm_matches_reference(rows, hidden, dtype):
    x, residual, weight = layer_inputs(rows, hidden, dtype, seed=rows)
    for res in (residual, None):
        normed, new_residual = add_rms_norm_cpu(x, res, weight, 1e-5)
        want_normed, want_residual = add_rms_norm_torch(x, res, weight, 1e-5)
        assert torch.equal(new_residual, want_residual)
        tol = TOL[dtype]
        torch.testing.assert_close(normed.float(), want_normed.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,dtype", ROTARY_CASES)
def test_rotary_matches_reference_bit_for_bit(rows, heads, kv_heads, head_dim, dtype):
    qkv, q, k, cos, sin = rotary_inputs(rows, heads, kv_heads, head_dim, dtype)
    want_q, want_k = rotary_torch(q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    got_q, got_k = rotary_cpu(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place, inside the fused qkv
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


def test_wrappers_reject_bad_inputs():
    k_cache, v_cache, meta = make_batch(1, 16, [(3, 1)], 2, 64, torch.float32)
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_attention_cpu(q.bfloat16(), k_cache, v_cache, meta, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention_cpu(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), meta, 0.1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention_cpu(torch.randn(1, 3, 64), k_cache, v_cache, meta, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_cpu(torch.randn(1, 4, 48), k_cache, v_cache, meta, 0.1)
    with pytest.raises(ValueError, match="rows"):
        paged_attention_cpu(torch.randn(2, 4, 64), k_cache, v_cache, meta, 0.1)
    x, residual, weight = layer_inputs(4, 64, torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm_cpu(x, residual, weight[:32], 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm_cpu(x.t(), None, weight, 1e-5)
    _qkv, q, k, cos, sin = rotary_inputs(3, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_cpu(q, k, cos[:2], sin[:2])
