"""Paged attention and KV writes as Triton kernels (GPUs: CUDA, and ROCm unchanged).

One attention kernel serves decode rows and prompt chunks alike: each program takes one
work item (all query rows of a decode sequence, or one row of a prompt chunk) and one KV
head, with all the query heads that share that KV head, and walks the item's blocks through
the block table with an online softmax: each KV block is read once per GQA group and, for a
decode with a draft, once for all of its positions, each row masked at its own causal end.
Long contexts are split over several programs (split-K), whose partial results a second
kernel combines:

    grid (items, kv_heads, splits)           grid (rows, heads)
    ┌──────────────────────────┐   m, l, acc   ┌───────────────────┐
    │ blocks [s*P, (s+1)*P) of │ ────────────► │ rescale and sum   │ ─► out
    │ this row's sequence      │  per split    │ the splits        │
    └──────────────────────────┘               └───────────────────┘

The cache layout is the torch reference's: [kv_heads, num_blocks, block_size, head_dim].
An 8-bit cache (kv_storage.py) is read as stored: its levels widened to the tile dtype
(exact: |level| <= 127), each key's scale multiplied into its scores and each value's scale
into its weights (the softmax's sum is taken before), in fp32. The KV write is in
kv_write_triton.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lucedesk.kernels.kv_storage import check_scales
from lucedesk.kernels.metadata import AttentionMetadata
from lucedesk.kernels.triton_numerics import _dot_dtype, interpreting_bf16, narrow, round_to_bf16

BLOCKS_PER_SPLIT = 16  # KV blocks one program covers before the context is split
# The most query rows x heads times head_dim one tile takes (a drafted decode's rows beyond
# it go to more work items): more spilled registers on gfx1151 (fp32 tiles: a quarter).
MAX_TILE = 64
MAX_TILE_VALUES = 4096


@triton.jit
def _attention_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    row_seq_ptr,
    row_pos_ptr,
    item_row_ptr,
    item_len_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    q_stride_t,
    q_stride_h,
    scale,
    window,
    num_heads,
    num_blocks,
    max_blocks_per_seq,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    # One work item: `n` consecutive query rows of one sequence (all rows of a decode, or one
    # row of a prompt chunk), tiled as TILE = rows x GROUP_PAD query heads:
    #   tile row t -> query row row0 + t // GROUP_PAD, head kv_head * GROUP + t % GROUP_PAD
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(item_row_ptr + item)
    n = tl.load(item_len_ptr + item)
    t = tl.arange(0, TILE)
    qi = t // GROUP_PAD
    g = t % GROUP_PAD
    rows = row0 + tl.minimum(qi, n - 1)  # padding rows mirror the last row
    seq = tl.load(row_seq_ptr + row0)
    pos = tl.load(row_pos_ptr + rows)  # [TILE]: each row sees keys first_key..pos
    first_key = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    # The item's first row sees the earliest key, its last row the latest.
    first_pos = tl.load(row_pos_ptr + row0)
    last_pos = tl.load(row_pos_ptr + row0 + n - 1)
    earliest = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    num_seq_blocks = last_pos // BLOCK_SIZE + 1
    first = tl.maximum(split * BLOCKS_PER_SPLIT, earliest // BLOCK_SIZE)
    last = tl.minimum(split * BLOCKS_PER_SPLIT + BLOCKS_PER_SPLIT, num_seq_blocks)

    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    live = (g < GROUP) & (qi < n)
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * q_stride_t + heads[:, None] * q_stride_h
    CHUNK: tl.constexpr = min(64, HEAD_DIM)
    dc = tl.arange(0, CHUNK)

    m = tl.full([TILE], float("-inf"), tl.float32)
    l_sum = tl.zeros([TILE], tl.float32)
    acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
    head_base = kv_head.to(tl.int64) * num_blocks
    for b in range(first, last):
        block = tl.load(block_tables_ptr + seq.to(tl.int64) * max_blocks_per_seq + b)
        cache_rows = (head_base + block) * BLOCK_SIZE + s  # [BLOCK_SIZE]
        # q.k over head_dim in chunks of 64, in a loop that is not unrolled, each q chunk
        # read again (volatile: not hoisted out of the loop over blocks): a q tile kept whole
        # in registers, as the matrix instructions lay it out, spilled on gfx1151, and
        # unrolled chunks in fp32 (no matrix instructions there) spilled on both AMD targets.
        scores = tl.zeros([TILE, BLOCK_SIZE], tl.float32)
        for c in tl.range(0, HEAD_DIM, CHUNK, num_stages=1):
            q = tl.load(q_rows + c + dc[None, :], mask=live[:, None], other=0.0, volatile=True)
            k = tl.load(k_cache_ptr + cache_rows[:, None] * HEAD_DIM + c + dc[None, :])
            scores += tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)
        scores = scores * scale  # [TILE, BS]
        v_rows = v_cache_ptr + cache_rows[:, None] * HEAD_DIM
        if QUANTIZED:  # int8 rows: each key's scale (the level products are exact)
            scores = scores * tl.load(k_scale_ptr + cache_rows)[None, :]
        key = b * BLOCK_SIZE + s
        visible = (key[None, :] <= pos[:, None]) & (key[None, :] >= first_key[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row that has seen no key yet (its window starts in a later block) stays empty.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if QUANTIZED:  # each value row's scale joins its weight
            p = p * tl.load(v_scale_ptr + cache_rows)[None, :]
        if EMULATE_BF16:  # what p.to(bf16) does on a GPU, in the interpreter's fp32 tiles
            p = round_to_bf16(p)
        v = tl.load(v_rows + d[None, :]).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m = m_new

    out = (rows * num_heads + heads) * num_splits + split
    tl.store(part_m_ptr + out, m, mask=live)
    tl.store(part_l_ptr + out, l_sum, mask=live)
    tl.store(part_acc_ptr + out[:, None] * HEAD_DIM + d[None, :], acc, mask=live[:, None])


@triton.jit
def _attention_reduce_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    out_ptr,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    # The splits CHUNK at a time (a 128k context has 512), merged as an online softmax
    # merges blocks. Splits past this row's context hold m = -inf and add nothing.
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, CHUNK)
    d = tl.arange(0, HEAD_DIM)
    base = (row * num_heads + head) * num_splits
    m_all = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    o = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        valid = s0 + sp < num_splits
        m = tl.load(part_m_ptr + base + s0 + sp, mask=valid, other=float("-inf"))
        l_sum = tl.load(part_l_ptr + base + s0 + sp, mask=valid, other=0.0)
        rows = (base + s0 + sp)[:, None] * HEAD_DIM + d[None, :]
        acc = tl.load(part_acc_ptr + rows, mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m_all, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        kept = tl.exp(m_all - m_safe)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        total = total * kept + tl.sum(l_sum * w, 0)
        o = o * kept + tl.sum(acc * w[:, None], 0)
        m_all = m_new
    if HAS_SINKS:  # the head's sink logit joins the denominator, with no value
        sink = tl.load(sinks_ptr + head)
        m_new = tl.maximum(m_all, sink)
        kept = tl.exp(m_all - m_new)
        total = total * kept + tl.exp(sink - m_new)
        o = o * kept
    out = narrow(o / total, out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + (row * num_heads + head) * HEAD_DIM + d, out)


def _check(name: str, t: torch.Tensor, dims: int, dtype: torch.dtype | None = None) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check("k_cache", k_cache, 4)
    _check("v_cache", v_cache, 4, k_cache.dtype)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ"
        )
    head_dim = k_cache.shape[3]
    if q.shape[-1] != head_dim or head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(
            f"head_dim must be a power of two from 16 to 256 and match the cache "
            f"(q {q.shape[-1]}, cache {head_dim})"
        )
    if k_cache.shape[2] not in (16, 32, 64, 128):
        raise ValueError(
            f"block_size {k_cache.shape[2]} must be 16, 32, 64 or 128 for the "
            "Triton kernels (their tiles are at least 16 rows)"
        )
    if q.device != k_cache.device:
        raise ValueError(f"q is on {q.device}, the cache on {k_cache.device}")


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 3 or t.stride(2) != 1:
        raise ValueError(
            f"{name} must be [tokens, heads, head_dim] with contiguous head_dim, "
            f"got shape {tuple(t.shape)} strides {t.stride()}"
        )


def max_tile(dtype: torch.dtype, head_dim: int) -> int:
    """The most query rows x heads a tile of this dtype and head size takes."""
    values = MAX_TILE_VALUES // (4 if dtype == torch.float32 else 1)
    return max(16, min(MAX_TILE, values // head_dim))


def _work_items(
    meta: AttentionMetadata, group_pad: int, dtype: torch.dtype, head_dim: int
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(first row, number of rows) per work item, and the rows a tile holds, per launch: one
    launch for the decode sequences with several rows (a drafted decode, its rows tiled
    together, at most MAX_TILE rows x heads a tile: a longer draft's rows in several
    items), one for every other row alone (so a prompt chunk's rows pay no padding)."""
    device = meta.seq_lens.device
    starts, nd = meta.query_start_cpu, meta.num_decodes
    most = max(1, max_tile(dtype, head_dim) // group_pad)
    items = [
        (row, min(most, end - row))
        for start, end in zip(starts[:nd], starts[1 : nd + 1])
        for row in range(start, end, most)
    ]
    rows_pad = triton.next_power_of_2(max((n for _, n in items), default=1))
    if rows_pad == 1:  # no drafts: every row is its own item
        rows = torch.arange(meta.num_tokens, dtype=torch.int32, device=device)
        return [(rows, torch.ones_like(rows), 1)]

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    decodes = (tensor([r for r, _ in items]), tensor([n for _, n in items]), rows_pad)
    first = meta.num_decode_tokens
    if first == meta.num_tokens:
        return [decodes]
    rows = torch.arange(first, meta.num_tokens, dtype=torch.int32, device=device)
    return [decodes, (rows, torch.ones_like(rows), 1)]


def attention_constants(
    dtype: torch.dtype,
    group: int,
    rows_pad: int,
    head_dim: int,
    block_size: int,
    quantized: bool,
    interpret: bool | None = None,
) -> dict:
    """The split kernel's constexprs for one launch: a tile of `rows_pad` query rows times
    the group's query heads (at least 16 rows: tl.dot's least), the dtypes of its dots."""
    group_pad = triton.next_power_of_2(group)
    tile = max(16, rows_pad * group_pad)
    return dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        TILE=tile,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCKS_PER_SPLIT=BLOCKS_PER_SPLIT,
        # fp32 stays exact (no TF32); half types multiply exactly in any case. "ieee" is the
        # one precision every target takes (AMD's have no TF32).
        PRECISION="ieee",
        DOT_DTYPE=_dot_dtype(dtype, interpret),
        EMULATE_BF16=interpreting_bf16(dtype, interpret),
        QUANTIZED=quantized,
        # Eight warps where a tile is big (four spilled on gfx1151 from 32 x 128) and in fp32.
        num_warps=4 if tile * head_dim <= 2048 and dtype != torch.float32 else 8,
    )


def paged_attention(
    q,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    sinks=None,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. q may be a
    view into the fused qkv projection (rows strided, head_dim contiguous). A row sees the
    last `window` keys (0: all); `sinks` (float32 [num_heads]) join each softmax; an int8
    cache comes with its float32 scales [kv_heads, num_blocks, block_size]."""
    _check_rows("q", q)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (q.shape[1],)):
        raise ValueError(f"sinks must be float32 [{q.shape[1]}], got {tuple(sinks.shape)}")
    check_scales(k_cache, v_cache, k_scale, v_scale)
    if q.dtype != k_cache.dtype and k_scale is None:
        raise ValueError(f"q must be {k_cache.dtype}, got {q.dtype}")
    _check_cache(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {kv_heads} KV heads")
    if num_tokens != meta.num_tokens:
        raise ValueError(f"q has {num_tokens} rows, the metadata {meta.num_tokens}")
    block_tables = meta.block_tables.contiguous()
    group = num_heads // kv_heads
    max_blocks = -(-meta.max_seq_len // block_size)
    splits = max(1, -(-max_blocks // BLOCKS_PER_SPLIT))
    seq, pos = meta.row_positions()
    part_acc = torch.empty(
        num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_m = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    group_pad = triton.next_power_of_2(group)
    for item_row, item_len, rows_pad in _work_items(meta, group_pad, q.dtype, head_dim):
        constants = attention_constants(
            q.dtype, group, rows_pad, head_dim, block_size, k_scale is not None
        )
        _attention_split_kernel[(item_row.shape[0], kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            part_m if k_scale is None else k_scale,
            part_m if v_scale is None else v_scale,
            block_tables,
            seq,
            pos,
            item_row,
            item_len,
            part_acc,
            part_m,
            part_l,
            q.stride(0),
            q.stride(1),
            scale,
            window,
            num_heads,
            num_blocks,
            block_tables.shape[1],
            splits,
            **constants,
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _attention_reduce_kernel[(num_tokens, num_heads)](
        part_acc,
        part_m,
        part_l,
        part_m if sinks is None else sinks.contiguous(),
        out,
        num_heads,
        splits,
        **reduce_constants(head_dim, sinks is not None, q.dtype),
    )
    return out


def reduce_constants(head_dim: int, sinks: bool, dtype: torch.dtype, interpret=None) -> dict:
    return dict(
        HEAD_DIM=head_dim,
        CHUNK=16,
        HAS_SINKS=sinks,
        EMULATE_BF16=interpreting_bf16(dtype, interpret),
    )
