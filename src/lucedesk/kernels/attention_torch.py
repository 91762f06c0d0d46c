"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

KV cache layout, one pair of tensors per layer, KV head outermost:

    k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]

A sequence's token at position p lives in block `block_table[p // block_size]`, row
`p % block_size`; flattened over (block, row), that is cache row
`block * block_size + p % block_size` (its "slot"). Head-major blocks make a gathered
sequence `[kv_heads, tokens, head_dim]` contiguous, the layout attention multiplies with,
so no copy is needed between the gather and the matmuls.

A step's rows are ordered decode sequences first (one query row each, or one per position of
a draft), then prompt chunks; a sequence's rows are its next `query_len` positions, each
seeing the keys up to its own position.

Two variants every implementation takes: a sliding `window` (a row at position p sees keys
p - window + 1 .. p; 0 = all keys) and attention `sinks` (float32 [num_heads]: one learned
logit per head that joins each softmax's denominator and adds no value, as gpt-oss has).

An 8-bit cache (int8 values, float32 scales per token and KV head: kv_storage.py) is
written quantized and read back dequantized to the query's dtype as it is gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lucedesk.kernels.kv_storage import LayerKV, check_scales, dequantize, quantize_rows
from lucedesk.kernels.metadata import AttentionMetadata


def write_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] cache rows.
    An int8 cache gets each token's row of each head quantized, its scale beside it."""
    check_scales(k_cache, v_cache, k_scale, v_scale)
    kv_heads, head_dim = k.shape[1], k.shape[2]
    rows = slot_mapping
    for new, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(kv_heads, -1, head_dim)  # [kvh, num_blocks * block_size, hd]
        if scales is None:
            flat.index_copy_(1, rows, new.transpose(0, 1).to(cache.dtype))
            continue
        levels, row_scales = quantize_rows(new)  # [T, kvh, hd] int8, [T, kvh] float32
        flat.index_copy_(1, rows, levels.transpose(0, 1))
        scales.view(kv_heads, -1).index_copy_(1, rows, row_scales.t())


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    Each row attends to its own sequence's cached tokens up to and including its position
    (the new K/V must already be written). k_scale / v_scale: an int8 cache's scales."""
    check_scales(k_cache, v_cache, k_scale, v_scale)
    kv = LayerKV(k_cache, v_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    rows = meta.num_decode_tokens
    if rows:
        out[:rows] = _decode(q[:rows], kv, meta, scale, window, sinks)
    prefill_chunks(q, kv, meta, scale, out, window, sinks)
    return out


def prefill_chunks(
    q: torch.Tensor,
    kv: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention for the step's prompt chunks (the sequences after the decodes), into `out`."""
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = meta.query_start_cpu[i], meta.query_start_cpu[i + 1]
        args = (q[start:end], kv, meta.block_tables[i], meta.seq_lens_cpu[i], scale)
        if window or sinks is not None:
            out[start:end] = _prefill_masked(*args, window, sinks)
        else:
            out[start:end] = _prefill(*args)


def _gather(
    kv: LayerKV, block_table: torch.Tensor, num_blocks: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """block ids [..., num_blocks] -> keys and values [kv_heads, ..., num_blocks * block_size,
    head_dim] in `dtype` (an int8 cache's blocks dequantized)."""
    ids = block_table[..., :num_blocks]
    k_blocks, v_blocks = kv.k[:, ids], kv.v[:, ids]  # [kvh, ..., nb, bs, hd], contiguous
    if kv.k_scale is not None and kv.v_scale is not None:
        k_blocks = dequantize(k_blocks, kv.k_scale[:, ids], dtype)
        v_blocks = dequantize(v_blocks, kv.v_scale[:, ids], dtype)
    return k_blocks.flatten(-3, -2), v_blocks.flatten(-3, -2)


def _decode(
    q: torch.Tensor,
    kv: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # q: [D, nh, hd], the decode sequences' query rows; each row attends as a one-query
    # decode ending at its own position. Grouped by KV head so K/V are never repeated.
    nd, D = meta.num_decodes, q.shape[0]
    kv_heads, block_size = kv.k.shape[0], kv.k.shape[2]
    max_len = max(meta.seq_lens_cpu[:nd])
    nb = -(-max_len // block_size)
    seq, pos = meta.row_positions()
    seq, row_lens = seq[:D], pos[:D, None] + 1  # [D], [D, 1]: each row's sequence and end
    keys, values = _gather(kv, meta.block_tables[seq], nb, q.dtype)  # [kvh, D, L, hd]
    nh, hd = q.shape[1], q.shape[2]
    qg = q.view(D, kv_heads, nh // kv_heads, hd).transpose(0, 1)  # [kvh, D, g, hd]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [kvh, D, g, L]
    positions = torch.arange(keys.shape[2], device=q.device)
    invalid = positions[None, :] >= row_lens  # [D, L]
    if window:  # the row sits at row_len - 1 and sees the last `window` keys
        invalid |= positions[None, :] < row_lens - window
    scores.masked_fill_(invalid[None, :, None, :], float("-inf"))
    sink = None if sinks is None else sinks.float().view(kv_heads, 1, nh // kv_heads, 1)
    probs = softmax_with_sinks(scores, sink).to(q.dtype)
    out = torch.matmul(probs, values)  # [kvh, D, g, hd]
    return out.transpose(0, 1).reshape(D, nh, hd)


def softmax_with_sinks(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis; a sink logit (broadcast to scores[..., :1]) joins each
    denominator and takes no share of the values."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    sink = sink.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _prefill(
    q: torch.Tensor,
    kv: LayerKV,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    # q: [n, nh, hd], the last n positions of a sequence whose cache holds seq_len tokens.
    block_size = kv.k.shape[2]
    nb = -(-seq_len // block_size)
    keys, values = _gather(kv, block_table, nb, q.dtype)  # [kvh, nb * block_size, hd]
    keys, values = keys[:, :seq_len], values[:, :seq_len]
    n = q.shape[0]
    if n == seq_len:
        # The whole sequence so far: plain causal attention, which SDPA runs as its fused
        # (flash) kernel; an explicit mask would send it down the unfused path.
        mask, causal = None, True
    else:
        # Row i sits at position seq_len - n + i and sees keys 0..that position.
        query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [n, L]
        causal = False
    # Batched 4-D inputs: with 3-D ones SDPA on the CPU skips its fused kernel (10x slower
    # for a 512-token chunk after 1,536 cached tokens).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, nh, n, hd]
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _prefill_masked(
    q: torch.Tensor,
    kv: LayerKV,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    # A chunk with a sliding window or sinks, which SDPA has no form for. Sinks alone: SDPA's
    # flash kernel with the softmax's log-sum-exp, the rows rescaled for the sink's share.
    # A window: explicit scores over only the keys some row of the chunk can see, read from
    # the block holding the first of them.
    block_size = kv.k.shape[2]
    n = q.shape[0]
    first = max(0, seq_len - n - window + 1) if window else 0
    first_block, nb = first // block_size, -(-seq_len // block_size)
    skip = first - first_block * block_size
    table = block_table[first_block:nb]
    keys, values = _gather(kv, table, nb - first_block, q.dtype)
    end = seq_len - first_block * block_size
    keys, values = keys[:, skip:end], values[:, skip:end]
    if not window and sinks is not None and FLASH_WITH_LSE is not None and q.is_cpu:
        return _flash_with_sinks(q, keys, values, scale, sinks)
    query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
    return attend(q, keys, values, query_pos, first, scale, window, sinks)


# SDPA's CPU flash kernel, which also returns each row's log-sum-exp (absent: the explicit
# path serves).
FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_with_sinks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """q: [n, nh, hd], the last n positions of a sequence whose keys/values [kvh, L, hd] are
    all there. With a sink logit s a row's softmax denominator grows from Z = exp(lse) to
    Z + exp(s): its output is scaled by Z / (Z + exp(s)) = sigmoid(lse - s)."""
    n, nh, _ = q.shape
    length = keys.shape[1]
    group = nh // keys.shape[0]
    k = keys.repeat_interleave(group, 0)[None]  # [1, nh, L, hd]
    v = values.repeat_interleave(group, 0)[None]
    query = q.transpose(0, 1)[None]  # [1, nh, n, hd]
    if n == length:
        out, lse = FLASH_WITH_LSE(query, k, v, 0.0, True, scale=scale)
    else:  # row i sits at position L - n + i
        pos = torch.arange(length, device=q.device)
        hidden = pos[None, :] > pos[length - n :, None]
        mask = torch.zeros(n, length, dtype=q.dtype, device=q.device)
        mask.masked_fill_(hidden, float("-inf"))
        out, lse = FLASH_WITH_LSE(query, k, v, 0.0, False, attn_mask=mask[None, None], scale=scale)
    share = torch.sigmoid(lse - sinks.float()[None, :, None])  # [1, nh, n]
    return (out.float() * share[..., None]).to(q.dtype)[0].transpose(0, 1)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: torch.Tensor,
    first_key_pos: int,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [n, nh, hd] at positions query_pos [n]; keys/values: [kvh, L, hd] at positions
    first_key_pos.. -> [n, nh, hd]. Causal, windowed and with sinks as asked."""
    n, nh, hd = q.shape
    kvh, length = keys.shape[0], keys.shape[1]
    qg = q.view(n, kvh, nh // kvh, hd).permute(1, 2, 0, 3)  # [kvh, g, n, hd]
    scores = torch.matmul(qg, keys[:, None].transpose(-1, -2)).float() * scale  # [kvh, g, n, L]
    key_pos = torch.arange(first_key_pos, first_key_pos + length, device=q.device)
    hidden = key_pos[None, :] > query_pos[:, None]  # [n, L]
    if window:
        hidden |= key_pos[None, :] <= query_pos[:, None] - window
    scores.masked_fill_(hidden, float("-inf"))
    sink = None if sinks is None else sinks.float().view(kvh, nh // kvh, 1, 1)
    probs = softmax_with_sinks(scores, sink).to(q.dtype)
    out = torch.matmul(probs, values[:, None])  # [kvh, g, n, hd]
    return out.permute(2, 0, 1, 3).reshape(n, nh, hd)


def causal_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal attention for one whole sequence, no cache: the plain reference.
    q: [n, nh, hd], k/v: [n, kvh, hd] -> [n, nh, hd]."""
    if window or sinks is not None:
        positions = torch.arange(q.shape[0], device=q.device)
        return attend(q, k.transpose(0, 1), v.transpose(0, 1), positions, 0, scale, window, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
