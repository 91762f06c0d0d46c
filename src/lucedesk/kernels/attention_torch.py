"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

KV cache layout, one pair of tensors per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A sequence's token at position p lives in block `block_table[p // block_size]`, row
`p % block_size`; flattened, that is cache row `block * block_size + p % block_size`
(its "slot"). A step's rows are ordered decode rows first (one query each), then prompt
chunks, each chunk the next `query_len` positions of its sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lucedesk.kernels.metadata import AttentionMetadata


def write_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] cache rows."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    Each row attends to its own sequence's cached tokens up to and including its position
    (the new K/V must already be written)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale)
    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_cpu[i], meta.query_start_cpu[i + 1]
        out[start:end] = _prefill(
            q[start:end], k_cache, v_cache, meta.block_tables[i], meta.seq_lens_cpu[i], scale
        )
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, kv_heads, head_dim]."""
    blocks = cache[block_table[..., :num_blocks]]  # [..., nb, bs, kvh, hd]
    return blocks.flatten(-4, -3)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    # q: [D, nh, hd]; one query per sequence, grouped by KV head so K/V are never repeated.
    nd = meta.num_decodes
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    seq_lens = meta.seq_lens[:nd]
    max_len = max(meta.seq_lens_cpu[:nd])
    nb = -(-max_len // block_size)
    keys = _gather(k_cache, meta.block_tables[:nd], nb)  # [D, L, kvh, hd]
    values = _gather(v_cache, meta.block_tables[:nd], nb)
    D, nh, hd = q.shape
    group = nh // kv_heads
    qg = q.view(D, kv_heads, group, hd)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * scale  # [D, kvh, g, L]
    positions = torch.arange(keys.shape[1], device=q.device)
    invalid = positions[None, :] >= seq_lens[:, None]  # [D, L]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [D, kvh, g, hd]
    return out.reshape(D, nh, hd)


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    # q: [n, nh, hd], the last n positions of a sequence whose cache holds seq_len tokens.
    block_size = k_cache.shape[1]
    nb = -(-seq_len // block_size)
    keys = _gather(k_cache, block_table, nb)[:seq_len]  # [L, kvh, hd]
    values = _gather(v_cache, block_table, nb)[:seq_len]
    n = q.shape[0]
    # Row i sits at position seq_len - n + i and sees keys 0..that position.
    query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [n, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [nh, n, hd]
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def causal_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense causal attention for one whole sequence, no cache: the plain reference.
    q: [n, nh, hd], k/v: [n, kvh, hd] -> [n, nh, hd]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
