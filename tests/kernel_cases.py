"""Inputs shared by the kernel tests (Triton in test_kernels.py, C++ in test_cpu_kernels.py):
random paged batches and activations, with their tolerances."""

from __future__ import annotations

import random

import torch

from lucedesk.kernels.metadata import AttentionMetadata

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(seed, block_size, seqs, kv_heads, head_dim, dtype, num_blocks=400, num_decodes=None):
    """`seqs`: (cached tokens before this step, new query rows) per sequence, decodes first
    (by default the sequences with one new row; `num_decodes` says how many when decodes
    carry drafts). Block tables are random, scattered picks of the pool; the first two
    sequences share their first block (as a shared prefix would)."""
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
    if num_decodes is None:
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
    # the other block sizes and the largest head dim that validation accepts
    (2, 64, torch.bfloat16, 64, [(0, 1), (63, 1), (200, 1), (70, 9)]),
    (4, 64, torch.float32, 128, [(1, 1), (130, 1), (255, 1), (100, 5)]),
    (2, 256, torch.float32, 16, [(3, 1), (90, 1), (17, 4)]),
    (1, 256, torch.bfloat16, 32, [(40, 1), (0, 6)]),
]


# (rows, hidden, dtype) for the norms; (rows, q heads, kv heads, head_dim, dtype) for rotary.
LAYER_CASES = [
    (1, 576, torch.float32),
    (37, 576, torch.bfloat16),
    (5, 1000, torch.float16),
    (300, 128, torch.bfloat16),
]
ROTARY_CASES = [
    (1, 9, 3, 64, torch.float32),
    (23, 9, 3, 64, torch.bfloat16),
    (7, 8, 2, 128, torch.float16),
    (130, 4, 4, 64, torch.bfloat16),
]


def layer_inputs(rows, hidden, dtype, seed=0, device="cpu", weight_dtype=None):
    """x, residual, weight as a decoder layer sees them (activations of varied scale); the
    weight in x's dtype, or in `weight_dtype` (float32: Gemma 3's and gpt-oss's norms)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(weight_dtype or dtype).to(device)
    return x, residual, weight


def rotary_inputs(rows, heads, kv_heads, head_dim, dtype, seed=0, device="cpu"):
    """q and k as views into one fused qkv (strided rows), and cos/sin rows of a real rope
    table at scattered positions."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q, k, _v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    positions = torch.randint(0, 8192, (rows,), generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.outer(positions.double(), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    return qkv, q, k, cos, sin


# Sliding windows and attention sinks: (gqa ratio, head_dim, dtype, block_size, seqs, window,
# sinks). Windows shorter and longer than a block, over contexts shorter and longer than the
# window, decode rows and prompt chunks (a chunk's early rows see keys its late rows do not).
WINDOW_CASES = [
    (1, 64, torch.float32, 16, [(0, 1), (5, 1), (300, 1), (20, 40)], 8, False),
    (4, 64, torch.float32, 16, [(130, 1), (7, 1), (90, 33), (0, 70)], 50, True),
    (2, 128, torch.float32, 32, [(1000, 1), (3, 1), (600, 9)], 0, True),
    (2, 64, torch.bfloat16, 16, [(200, 1), (31, 1), (100, 20)], 17, True),
    (8, 64, torch.bfloat16, 16, [(64, 1), (15, 1), (48, 30)], 64, False),
    (1, 256, torch.float32, 32, [(40, 1), (700, 1), (0, 50)], 33, True),
]


# Decode sequences with several query rows (a drafted decode: one row per position, each
# with its own causal end), then prompt chunks: (gqa ratio, head_dim, dtype, block_size, seqs,
# num_decodes, window, sinks). Contexts that end mid-block and rows that cross a block edge,
# one-row decodes among them, windows shorter than the rows of a sequence.
MULTI_QUERY_CASES = [
    (1, 64, torch.float32, 16, [(0, 1), (15, 5), (300, 3), (2099, 4), (20, 7)], 4, 0, False),
    (4, 64, torch.bfloat16, 16, [(16, 2), (5, 5), (700, 1), (33, 4), (0, 9)], 4, 0, False),
    (3, 64, torch.float32, 128, [(126, 5), (1, 2), (255, 3), (40, 6)], 3, 0, True),
    (2, 64, torch.float32, 16, [(30, 5), (3, 4), (200, 5), (100, 20)], 3, 17, True),
    (8, 128, torch.bfloat16, 32, [(64, 3), (1, 2), (511, 5)], 3, 40, True),
    (2, 128, torch.bfloat16, 64, [(63, 1), (127, 5), (1000, 4), (10, 30)], 3, 3, False),
    (3, 64, torch.float16, 32, [(31, 5), (90, 2), (0, 3)], 2, 0, False),
    (2, 256, torch.float32, 16, [(17, 4), (0, 5)], 2, 9, False),
    # a draft longer than a tile takes (4 heads of 256: four rows a tile): in five items
    (4, 256, torch.bfloat16, 16, [(40, 17), (3, 9), (0, 2)], 2, 0, True),
]

# The C++ kernel's bf16 scores for many query heads over a block come from its keys
# regrouped once for all of them (at least head_dim / 16 heads; of 64 columns, three), for
# few straight from the cache: a one-row decode of 1 head of 32 columns, 2 of 64 or 4 of
# 256 takes the second way, a drafted row's positions the first (3-24 heads, one-row decodes
# of three heads of 32 or 64 columns among them), and both must give the same bits; heads of
# up to 64 columns are dotted two at a time there, an odd one alone. Contexts ending part-way
# through sixteen keys.
CPU_MULTI_QUERY_CASES = MULTI_QUERY_CASES + [
    (3, 64, torch.bfloat16, 32, [(0, 6), (45, 8), (1000, 5), (17, 1), (9, 3)], 4, 0, False),
    (4, 256, torch.bfloat16, 16, [(300, 5), (33, 4), (70, 1)], 3, 100, True),
    (2, 64, torch.bfloat16, 16, [(100, 1), (37, 6), (500, 3), (15, 2)], 4, 0, False),
    # 32 columns: two heads regroup, and an odd count leaves one head of a pair alone
    (3, 32, torch.bfloat16, 16, [(40, 7), (300, 5), (5, 1), (77, 2)], 4, 0, False),
    (1, 32, torch.bfloat16, 16, [(40, 7), (5, 1), (77, 2)], 3, 0, False),
]


def one_query_per_position(meta, block_size):
    """The same step with each decode row its own one-query sequence: a row's result must
    not depend on whether its sequence's other rows share its pass over the blocks."""
    query_lens, seq_lens, tables = [], [], []
    num_decodes = 0
    for i in range(meta.num_seqs):
        n = meta.query_start_cpu[i + 1] - meta.query_start_cpu[i]
        seq_len, table = meta.seq_lens_cpu[i], meta.block_tables[i].tolist()
        if i < meta.num_decodes:
            query_lens += [1] * n
            seq_lens += range(seq_len - n + 1, seq_len + 1)
            tables += [table] * n
            num_decodes += n
        else:
            query_lens.append(n)
            seq_lens.append(seq_len)
            tables.append(table)
    return AttentionMetadata.build(
        query_lens, seq_lens, tables, block_size, num_decodes, device=meta.seq_lens.device
    )


def multi_query_case(ratio, head_dim, dtype, block_size, seqs, num_decodes, window, sinks):
    """q, caches, metadata, scale, window and sinks for one of MULTI_QUERY_CASES."""
    kv_heads = 2
    k_cache, v_cache, meta = make_batch(
        len(seqs) + head_dim, block_size, seqs, kv_heads, head_dim, dtype, num_decodes=num_decodes
    )
    g = torch.Generator().manual_seed(window + ratio)
    q = torch.randn(meta.num_tokens, kv_heads * ratio, head_dim, generator=g).to(dtype)
    sink = random_sinks(kv_heads * ratio, window) if sinks else None
    return q.to(DEVICE), k_cache, v_cache, meta, head_dim**-0.5, window, sink


def random_sinks(num_heads: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=g) * 2).to(DEVICE)


def naive_attention(q, k_cache, v_cache, meta, scale, window=0, sinks=None) -> torch.Tensor:
    """Row by row in float64, straight from the definitions: the reference the torch
    implementation itself is checked against."""
    kv_heads, _, block_size, head_dim = k_cache.shape
    num_heads = q.shape[1]
    group = num_heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i in range(meta.num_seqs):
        qlen = meta.query_start_cpu[i + 1] - meta.query_start_cpu[i]
        seq_len = meta.seq_lens_cpu[i]
        table = meta.block_tables[i].tolist()
        for offset in range(qlen):
            pos = seq_len - qlen + offset
            first = max(0, pos - window + 1) if window else 0
            keys = range(first, pos + 1)
            for h in range(num_heads):
                kvh = h // group
                k = torch.stack(
                    [k_cache[kvh, table[j // block_size], j % block_size] for j in keys]
                ).double()
                v = torch.stack(
                    [v_cache[kvh, table[j // block_size], j % block_size] for j in keys]
                ).double()
                s = (k @ q[row, h].double()) * scale
                if sinks is not None:
                    s = torch.cat([s, sinks[h : h + 1].double()])
                p = torch.softmax(s, 0)[: len(keys)]
                out[row, h] = p @ v
            row += 1
    return out


def int8_caches(k_cache, v_cache):
    """The caches at 8 bits as the KV write stores them (int8 levels, float32 scales per
    token and KV head), and float32 copies of the values they hold: what an int8 kernel
    reads, and what its reference must see."""
    from lucedesk.kernels.kv_storage import dequantize, quantize_rows

    (kq, ks), (vq, vs) = quantize_rows(k_cache), quantize_rows(v_cache)
    held = (dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32))
    return (kq, vq, ks, vs), held
