"""The C++ flash kernel for prompt chunks (csrc/prefill.h), bf16 and 8-bit caches: against the fp32
reference across GQA groups, head dims, block sizes, windows, sinks and long prefixes (more
than one span of 64 keys, rows of one task at different positions); a prompt row's result
the same bit for bit whatever chunk it comes in and whatever shares its step; and the op's
own checks. The kernel needs AVX512-BF16: on a CPU without it these tests fail rather than
pass through the SDPA path unseen."""

from __future__ import annotations

import pytest
import torch

from lucedesk.kernels.attention_torch import paged_attention_torch
from lucedesk.kernels.cpu import paged_attention_cpu
from lucedesk.kernels.cpu_build import load_cpu_ops
from lucedesk.kernels.metadata import AttentionMetadata
from tests.kernel_cases import TOL, int8_caches, make_batch, random_sinks

CHUNK_CASES = [
    # (gqa ratio, kv heads, head_dim, block_size, [(cached, new), ...], window, sinks)
    (4, 1, 256, 16, [(0, 130), (700, 97)], 0, False),  # Gemma 3's global layers' shape
    (4, 1, 256, 16, [(600, 200), (0, 70)], 512, False),  # ...and its local ones
    (3, 3, 64, 16, [(10, 1), (0, 300), (1000, 45)], 0, False),  # decodes beside chunks
    (8, 1, 64, 32, [(3, 1), (129, 64), (63, 2)], 0, True),  # sinks (gpt-oss)
    (8, 1, 64, 16, [(250, 77), (5, 1), (0, 40)], 100, True),  # window and sinks
    (2, 2, 128, 64, [(0, 1), (191, 129), (40, 300)], 7, False),  # a window under a span
    (1, 2, 80, 16, [(77, 33), (0, 65)], 0, False),  # head_dim 64 + 16
    (2, 1, 48, 16, [(33, 90)], 64, True),  # head_dim 3 x 16, window one span
]


def chunk_case(ratio, kv_heads, head_dim, block_size, seqs, window, sinks, seed=0):
    k_cache, v_cache, meta = make_batch(
        seed + head_dim + window, block_size, seqs, kv_heads, head_dim, torch.bfloat16, 200
    )
    g = torch.Generator().manual_seed(seed + window)
    q = torch.randn(meta.num_tokens, kv_heads * ratio, head_dim, generator=g).bfloat16()
    sink = random_sinks(kv_heads * ratio, window) if sinks else None
    return q, k_cache, v_cache, meta, head_dim**-0.5, window, sink


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_prompt_chunks_match_reference(case):
    q, k_cache, v_cache, meta, scale, window, sink = chunk_case(*case)
    got = paged_attention_cpu(q, k_cache, v_cache, meta, scale, window, sink)
    f32 = [t.float() for t in (q, k_cache, v_cache)]
    want = paged_attention_torch(*f32, meta, scale, window, sink)
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CHUNK_CASES[::2])
def test_prompt_chunks_over_an_8_bit_cache_match_reference(case):
    """An int8 cache's rows are dequantized to bf16 as they are tiled, as the torch
    reference's gather does."""
    q, k_cache, v_cache, meta, scale, window, sink = chunk_case(*case)
    (kq, vq, ks, vs), (k32, v32) = int8_caches(k_cache, v_cache)
    got = paged_attention_cpu(q, kq, vq, meta, scale, window, sink, k_scale=ks, v_scale=vs)
    want = paged_attention_torch(q.float(), k32, v32, meta, scale, window, sink)
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _chunked(q, k_cache, v_cache, table, cuts, scale, window, sink, beside=None, scales=()):
    """Rows 0..len(q)-1 of one prompt, prefilled in pieces ending at `cuts`; `beside`: the
    caches' other sequence (cached, new) in the same step, its rows discarded."""
    block_size = k_cache.shape[2]
    rows, start = [], 0
    for end in cuts:
        query_lens, seq_lens, tables = [end - start], [end], [table]
        if beside is not None:
            query_lens.append(beside[1])
            seq_lens.append(sum(beside))
            tables.append(list(range(150, 150 + -(-sum(beside) // block_size))))
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, 0)
        step_q = q[start:end]
        if beside is not None:
            step_q = torch.cat([step_q, torch.randn(beside[1], *q.shape[1:]).bfloat16()])
        out = paged_attention_cpu(step_q, k_cache, v_cache, meta, scale, window, sink, *scales)
        rows.append(out[: end - start])
        start = end
    return torch.cat(rows)


@pytest.mark.parametrize(
    "window,sinks,cache", [(0, False, "bf16"), (100, True, "bf16"), (64, False, "int8")]
)
def test_a_prompt_row_is_the_same_in_any_chunk(window, sinks, cache):
    """Spans sit at fixed positions and a row skips those it sees nothing of, so chunking
    and the step's other sequences cannot change a row's bits."""
    length, heads, kv_heads, head_dim = 700, 8, 2, 64
    g = torch.Generator().manual_seed(window)
    k_cache = torch.randn(kv_heads, 200, 16, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(kv_heads, 200, 16, head_dim, generator=g).bfloat16()
    q = torch.randn(length, heads, head_dim, generator=g).bfloat16()
    table = list(range(0, 2 * 44, 2))  # every other block: scattered in the pool
    sink = random_sinks(heads, 3) if sinks else None
    scales = ()
    if cache == "int8":
        (k_cache, v_cache, *scales), _ = int8_caches(k_cache, v_cache)
    args = (q, k_cache, v_cache, table)
    whole = _chunked(*args, [length], 0.125, window, sink, scales=scales)
    for cuts, beside in (([256, 600, 700], None), ([1, 65, 333, 700], (40, 30))):
        assert torch.equal(_chunked(*args, cuts, 0.125, window, sink, beside, scales), whole)


def test_the_op_checks_its_arguments():
    ops = load_cpu_ops()
    k_cache, v_cache, meta = make_batch(1, 16, [(0, 5)], 1, 64, torch.bfloat16, 10)
    q = torch.randn(5, 2, 64).bfloat16()
    args = [meta.block_tables, meta.seq_lens, meta.query_start, 0.1, 0, None, None, None]
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.paged_prefill_attention(q.float(), q.float(), k_cache, v_cache, *args)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.paged_prefill_attention(q[..., :40], q[..., :40], k_cache, v_cache, *args)
    with pytest.raises(RuntimeError, match="window"):
        ops.paged_prefill_attention(q.clone(), q, k_cache, v_cache, *args[:4], -1, *args[5:])
    with pytest.raises(RuntimeError, match="sinks"):
        ops.paged_prefill_attention(
            q.clone(), q, k_cache, v_cache, *args[:5], torch.zeros(3), *args[6:]
        )
    past_q = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="past q's rows"):
        ops.paged_prefill_attention(q.clone(), q, k_cache, v_cache, *args[:2], past_q, *args[3:])
    outside = meta.block_tables.clone()
    outside[0, 0] = 10
    with pytest.raises(RuntimeError, match="block 10 out of range"):
        ops.paged_prefill_attention(q.clone(), q, k_cache, v_cache, outside, *args[1:])
    with pytest.raises(RuntimeError, match="k_scale and v_scale"):
        ops.paged_prefill_attention(
            q.clone(), q, k_cache.to(torch.int8), v_cache.to(torch.int8), *args
        )
