"""Triton kernels against their torch references (in Triton's interpreter on a CPU): random
block tables with scattered and shared blocks, partial last blocks, contexts from 1 to a few
thousand tokens, decode rows mixed with prompt chunks, GQA ratios 1, 3, 4 and 8.

Tolerances per dtype: fp32 1e-5, fp16 2e-3, bf16 2e-2 (absolute and relative)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from lucedesk.kernels.attention_torch import paged_attention_torch, write_kv_torch  # noqa: E402
from lucedesk.kernels.attention_triton import paged_attention, write_kv  # noqa: E402
from lucedesk.kernels.metadata import AttentionMetadata  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(seed, block_size, seqs, kv_heads, head_dim, dtype, num_blocks=400):
    """`seqs`: (cached tokens before this step, new query rows) per sequence, decodes first.
    Block tables are random, scattered picks of the pool; the first two sequences share
    their first block (as a shared prefix would)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, query_lens, seq_lens = [], [], []
    for cached, new in seqs:
        total = cached + new
        tables.append([free.pop() for _ in range(-(-total // block_size))])
        query_lens.append(new)
        seq_lens.append(total)
    if len(tables) > 1 and seq_lens[0] > block_size and seq_lens[1] > block_size:
        tables[1][0] = tables[0][0]
    num_decodes = sum(1 for _, new in seqs if new == 1)
    meta = AttentionMetadata.build(
        query_lens, seq_lens, tables, block_size, num_decodes, device=DEVICE
    )
    return k_cache.to(DEVICE), v_cache.to(DEVICE), meta


CASES = [
    # (gqa ratio, head_dim, dtype, block_size, [(cached, new), ...])
    (1, 64, torch.float32, 16, [(0, 1), (16, 1), (299, 1), (2099, 1)]),
    (3, 64, torch.float32, 16, [(4, 1), (63, 1), (512, 1), (20, 7), (0, 12)]),
    (4, 128, torch.float32, 32, [(40, 1), (700, 1), (33, 5), (0, 17)]),
    (8, 64, torch.float32, 16, [(1, 1), (100, 1), (31, 9)]),
    (4, 64, torch.bfloat16, 16, [(10, 1), (300, 1), (15, 6), (0, 3)]),
    (3, 128, torch.float16, 32, [(70, 1), (1000, 1), (48, 4)]),
    (8, 128, torch.bfloat16, 16, [(2, 1), (600, 1), (5, 11)]),
]


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
