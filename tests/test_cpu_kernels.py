"""The C++ CPU kernels against their torch references: paged decode attention over random,
scattered and shared blocks (with prompt chunks in the same step taking the torch path),
residual-add + RMSNorm and rotary in every dtype; and the wrappers' checks.

Tolerances per dtype as in kernel_cases.TOL; rotary and the residual add round exactly
where torch does, so they are compared bit for bit."""

from __future__ import annotations

import pytest
import torch

from lucedesk.kernels.attention_torch import paged_attention_torch, write_kv_torch
from lucedesk.kernels.cpu import add_rms_norm_cpu, paged_attention_cpu, rotary_cpu, write_kv_cpu
from lucedesk.kernels.layers_torch import add_rms_norm_torch, rotary_torch
from lucedesk.kernels.quantized import Int8Weight
from tests.kernel_cases import (
    CASES,
    CPU_MULTI_QUERY_CASES,
    LAYER_CASES,
    MULTI_QUERY_CASES,
    ROTARY_CASES,
    TOL,
    WINDOW_CASES,
    int8_caches,
    layer_inputs,
    make_batch,
    multi_query_case,
    naive_attention,
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
    scale = head_dim**-0.5
    got = paged_attention_cpu(q, k_cache, v_cache, meta, scale)
    want = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def window_case(ratio, head_dim, dtype, block_size, seqs, window, sinks):
    kv_heads = 2
    k_cache, v_cache, meta = make_batch(
        window + head_dim, block_size, seqs, kv_heads, head_dim, dtype
    )
    g = torch.Generator().manual_seed(window)
    q = torch.randn(meta.num_tokens, kv_heads * ratio, head_dim, generator=g).to(dtype)
    sink = random_sinks(kv_heads * ratio, window) if sinks else None
    return q, k_cache, v_cache, meta, head_dim**-0.5, window, sink


@pytest.mark.parametrize("case", WINDOW_CASES[:4])
def test_torch_reference_windows_and_sinks_follow_the_definition(case):
    q, k_cache, v_cache, meta, scale, window, sink = window_case(*case)
    f32 = [t.float() for t in (q, k_cache, v_cache)]
    got = paged_attention_torch(*f32, meta, scale, window, sink)
    want = naive_attention(*f32, meta, scale, window, sink)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_windows_and_sinks_match_reference(case):
    q, k_cache, v_cache, meta, scale, window, sink = window_case(*case)
    dtype = q.dtype
    got = paged_attention_cpu(q, k_cache, v_cache, meta, scale, window, sink)
    f32 = [t.float() for t in (q, k_cache, v_cache)]
    want = paged_attention_torch(*f32, meta, scale, window, sink)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.fixture
def two_threads():
    """The kernels' schedule (tasks split or shared out, keys regrouped or not for a task's
    heads) follows the thread count: the cases below are chosen for two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "kv_heads,heads,head_dim,window,draft,int8",
    [
        (3, 9, 64, 0, 1, False),
        (3, 9, 64, 0, 4, False),
        (3, 6, 32, 0, 1, False),
        (1, 4, 256, 200, 1, False),
        (1, 4, 256, 0, 1, False),
        (2, 4, 128, 1100, 1, False),
        (1, 2, 256, 0, 1, False),
        (1, 4, 256, 0, 4, False),
        (1, 4, 256, 1100, 3, True),
    ],
)
def test_decode_rows_do_not_depend_on_the_batch(
    two_threads, kv_heads, heads, head_dim, window, draft, int8
):
    """A sequence's output is the same alone or among others, bit for bit: alone, its KV
    heads go whole to the threads (two or three of them), or its one KV head's query heads
    are split over the threads (a short context), or its keys and then its columns are (one
    or two KV heads of 128 or more columns over 1,024 keys or more, with a draft's rows,
    over an 8-bit cache), or its keys alone (three heads of 64 or 32 columns over 1,400
    keys, with a draft's rows or not; its shorter sequences go whole); among the others,
    none of these. (On two threads 4 sequences x KV heads are tasks
    enough; 1 is not.)"""
    check_rows_alone_and_among_others(kv_heads, heads, head_dim, window, draft, int8)


def check_rows_alone_and_among_others(kv_heads, heads, head_dim, window, draft, int8):
    seqs = [(300, 1), (17, 1), (1400, draft), (64, 1)]
    k_cache, v_cache, meta = make_batch(
        3, 16, seqs, kv_heads, head_dim, torch.bfloat16, num_decodes=len(seqs)
    )
    scales = {}
    if int8:
        (k_cache, v_cache, k_scale, v_scale), _ = int8_caches(k_cache, v_cache)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    q = torch.randn(meta.num_tokens, heads, head_dim).bfloat16()
    sinks = torch.randn(heads) if window else None
    together = paged_attention_cpu(q, k_cache, v_cache, meta, 0.125, window, sinks, **scales)
    starts = meta.query_start.tolist()
    for i in range(len(seqs)):
        a, b = starts[i], starts[i + 1]
        alone_meta = type(meta).build(
            [b - a], [meta.seq_lens_cpu[i]], [meta.block_tables[i].tolist()], 16, 1
        )
        alone = paged_attention_cpu(
            q[a:b], k_cache, v_cache, alone_meta, 0.125, window, sinks, **scales
        )
        assert torch.equal(alone, together[a:b])


@pytest.mark.parametrize("case", CPU_MULTI_QUERY_CASES)
def test_multi_query_decodes_match_reference(case):
    """Decode sequences of several rows, each row seeing keys up to its own position."""
    q, k_cache, v_cache, meta, scale, window, sink = multi_query_case(*case)
    got = paged_attention_cpu(q, k_cache, v_cache, meta, scale, window, sink)
    f32 = [t.float() for t in (q, k_cache, v_cache)]
    want = paged_attention_torch(*f32, meta, scale, window, sink)
    tol = TOL[q.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", MULTI_QUERY_CASES[:4])
def test_torch_reference_multi_query_decodes_follow_the_definition(case):
    q, k_cache, v_cache, meta, scale, window, sink = multi_query_case(*case)
    f32 = [t.float() for t in (q, k_cache, v_cache)]
    got = paged_attention_torch(*f32, meta, scale, window, sink)
    want = naive_attention(*f32, meta, scale, window, sink)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CPU_MULTI_QUERY_CASES)
def test_multi_query_decodes_equal_one_query_per_position_bit_for_bit(two_threads, case):
    """One pass over the blocks for all of a sequence's rows gives each row exactly what it
    gets as a one-query decode, in every dtype (bf16 on its vector path where the CPU has
    one); the torch reference too."""
    q, k_cache, v_cache, meta, scale, window, sink = multi_query_case(*case)
    together = paged_attention_cpu(q, k_cache, v_cache, meta, scale, window, sink)
    apart_meta = one_query_per_position(meta, k_cache.shape[2])
    apart = paged_attention_cpu(q, k_cache, v_cache, apart_meta, scale, window, sink)
    assert torch.equal(together, apart)
    assert torch.equal(
        paged_attention_torch(q, k_cache, v_cache, meta, scale, window, sink),
        paged_attention_torch(q, k_cache, v_cache, apart_meta, scale, window, sink),
    )


INT8_CASES = [(*c, 0, False) for c in CASES[::2]] + [(*c[:5], c[5], c[6]) for c in WINDOW_CASES]


@pytest.mark.parametrize("ratio,head_dim,dtype,block_size,seqs,window,sinks", INT8_CASES)
def test_int8_cache_attention_matches_reference(
    ratio, head_dim, dtype, block_size, seqs, window, sinks
):
    """Over an 8-bit cache (levels and scales read as stored), the result is the reference's
    over the values the cache holds, within the dtype's tolerance; the torch reference on
    the int8 cache is itself that computation (exactly, in fp32)."""
    q, k_cache, v_cache, meta, scale, window, sink = window_case(
        ratio, head_dim, dtype, block_size, seqs, window, sinks
    )
    (kq, vq, ks, vs), (k_held, v_held) = int8_caches(k_cache, v_cache)
    got = paged_attention_cpu(q, kq, vq, meta, scale, window, sink, k_scale=ks, v_scale=vs)
    want = paged_attention_torch(q.float(), k_held, v_held, meta, scale, window, sink)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    reference = paged_attention_torch(
        q.float(), kq, vq, meta, scale, window, sink, k_scale=ks, v_scale=vs
    )
    assert torch.equal(reference, want)


@pytest.mark.parametrize("case", CPU_MULTI_QUERY_CASES)
def test_int8_multi_query_decodes_match_reference_and_one_query_per_position(two_threads, case):
    q, k_cache, v_cache, meta, scale, window, sink = multi_query_case(*case)
    (kq, vq, ks, vs), (k_held, v_held) = int8_caches(k_cache, v_cache)
    scales = {"k_scale": ks, "v_scale": vs}
    together = paged_attention_cpu(q, kq, vq, meta, scale, window, sink, **scales)
    want = paged_attention_torch(q.float(), k_held, v_held, meta, scale, window, sink)
    tol = TOL[q.dtype]
    torch.testing.assert_close(together.float(), want, atol=tol, rtol=tol)
    apart_meta = one_query_per_position(meta, k_cache.shape[2])
    apart = paged_attention_cpu(q, kq, vq, apart_meta, scale, window, sink, **scales)
    assert torch.equal(together, apart)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_kv_write_round_trips_within_half_a_level(dtype):
    """Each written row comes back within max|row| / 254 per element, and a row's bytes are
    the same whether its token is written alone or among others."""
    g = torch.Generator().manual_seed(5)
    kvh, num_blocks, block_size, hd, tokens = 3, 12, 16, 64, 40
    k = torch.randn(tokens, kvh, hd, generator=g) * torch.rand(tokens, kvh, 1, generator=g) * 8
    v = torch.randn(tokens, kvh, hd, generator=g)
    k[3] = 0  # an all-zero row: scale 0, values 0
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    shape = (kvh, num_blocks, block_size, hd)

    def fresh():
        return [torch.zeros(shape, dtype=torch.int8) for _ in range(2)] + [
            torch.zeros(shape[:3]) for _ in range(2)
        ]

    kq, vq, ks, vs = fresh()
    write_kv_torch(k, v, kq, vq, slots, k_scale=ks, v_scale=vs)
    for new, levels, scales in ((k, kq, ks), (v, vq, vs)):
        flat_levels = levels.view(kvh, -1, hd)[:, slots].transpose(0, 1)  # [T, kvh, hd]
        flat_scales = scales.view(kvh, -1)[:, slots].t()  # [T, kvh]
        back = flat_levels.float() * flat_scales[..., None]
        bound = new.float().abs().amax(-1, keepdim=True) / 254
        # half a level, and the float rounding of x / s and of level * s
        assert ((back - new.float()).abs() <= bound * (1 + 1e-4)).all()
    assert (kq.view(kvh, -1, hd)[:, slots[3]] == 0).all() and (
        ks.view(kvh, -1)[:, slots[3]] == 0
    ).all()
    one_by_one = fresh()
    for t in range(tokens):
        write_kv_torch(
            k[t : t + 1],
            v[t : t + 1],
            one_by_one[0],
            one_by_one[1],
            slots[t : t + 1],
            k_scale=one_by_one[2],
            v_scale=one_by_one[3],
        )
    assert all(torch.equal(a, b) for a, b in zip((kq, vq, ks, vs), one_by_one))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_kv_write_in_cpp_equals_torch_bit_for_bit(dtype):
    """The C++ write into an 8-bit cache gives kv_storage.quantize_rows' levels and scales,
    from k and v as views into one fused qkv (strided rows), an all-zero row included."""
    g = torch.Generator().manual_seed(7)
    kvh, num_blocks, block_size, hd, tokens = 2, 10, 16, 64, 37
    qkv = torch.randn(tokens, (4 + 2 * kvh) * hd, generator=g) * 5
    qkv[:, ::7] = torch.round(qkv[:, ::7])  # some values on exact level boundaries
    qkv = qkv.to(dtype)
    k = qkv[:, 4 * hd : (4 + kvh) * hd].view(tokens, kvh, hd)
    v = qkv[:, (4 + kvh) * hd :].view(tokens, kvh, hd)
    k[5] = 0
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    shape = (kvh, num_blocks, block_size, hd)
    written = []
    for write in (write_kv_torch, write_kv_cpu):
        caches = [torch.zeros(shape, dtype=torch.int8) for _ in range(2)]
        scales = [torch.full(shape[:3], -1.0) for _ in range(2)]
        write(k, v, *caches, slots, k_scale=scales[0], v_scale=scales[1])
        written.append(caches + scales)
    assert all(torch.equal(a, b) for a, b in zip(*written))


def test_int8_caches_need_their_scales():
    k_cache, v_cache, meta = make_batch(1, 16, [(3, 1)], 2, 64, torch.float32)
    (kq, vq, ks, vs), _ = int8_caches(k_cache, v_cache)
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_attention_cpu(q, kq, vq, meta, 0.1)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_attention_torch(q, k_cache, v_cache, meta, 0.1, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="k_scale must be contiguous float32"):
        paged_attention_cpu(q, kq, vq, meta, 0.1, k_scale=ks.double(), v_scale=vs)


@pytest.mark.parametrize("float32_weight", [False, True])
@pytest.mark.parametrize("rows,hidden,dtype", LAYER_CASES)
def test_add_rms_norm_matches_reference(rows, hidden, dtype, float32_weight):
    """A float32 weight (Gemma 3's and gpt-oss's norms) multiplies before the one rounding."""
    weight_dtype = torch.float32 if float32_weight else None
    x, residual, weight = layer_inputs(rows, hidden, dtype, seed=rows, weight_dtype=weight_dtype)
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


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (40, 96)])
def test_int8_weights_match_their_dequantized_matmul(n, k):
    """Both layouts: tiles for AMX where the shape allows (and the CPU has it), rows else.
    Each group of 32 loses at most 1/510 of its range."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    weight = Int8Weight(w)
    assert weight.nbytes < w.numel() * 2  # smaller than bf16
    deq = weight.dequantize()
    ranges = w.view(n, -1, 32).amax(-1) - w.view(n, -1, 32).amin(-1)
    assert ((deq - w).view(n, -1, 32).abs().amax(-1) <= ranges / 510 + 1e-7).all()
    x = torch.randn(37, k, generator=g).bfloat16()
    want = x.float() @ deq.bfloat16().float().t()
    got = weight(x).float()
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()


def test_int8_weights_keep_llama_cpp_grids_exactly():
    """Groups as Q8_0, Q4_0 and Q4_1 store them come back exactly."""
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(32, 4, 1, generator=g) * 0.01).half().float()
    q8 = torch.randint(-127, 128, (32, 4, 32), generator=g).float()
    q8[..., 0] = 127  # Q8_0: scale = max|w| / 127
    q4 = torch.randint(0, 16, (32, 4, 32), generator=g).float()
    q4[..., 0] = 0  # Q4_0: scale = (value of largest magnitude) / -8
    q4_1 = torch.randint(0, 16, (32, 4, 32), generator=g).float()
    q4_1[..., 0], q4_1[..., 1] = 0, 15  # Q4_1: min and max are levels 0 and 15
    minimum = -(torch.rand(32, 4, 1, generator=g) * 0.05).half().float()
    for w in (q8 * d, (q4 - 8) * d, q4_1 * d + minimum):
        w = w.reshape(32, 128)
        torch.testing.assert_close(Int8Weight(w).dequantize(), w, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("n,k", [(960, 576), (40, 96)])
def test_int8_rows_do_not_depend_on_the_batch(n, k):
    """A row's output is the same bits alone, in a small batch or deep in a big one (on AMX
    tiles: whatever its position within a 16-row tile)."""
    g = torch.Generator().manual_seed(7)
    weight = Int8Weight(torch.randn(n, k, generator=g))
    x = torch.randn(45, k, generator=g).bfloat16()
    together = weight(x)
    for start, end in [(0, 1), (3, 4), (5, 21), (17, 18), (30, 45), (44, 45)]:
        assert torch.equal(weight(x[start:end]), together[start:end])


def test_int8_weights_take_bfloat16_only():
    weight = Int8Weight(torch.randn(32, 64))
    with pytest.raises(ValueError, match="bfloat16"):
        weight(torch.randn(2, 64))
    with pytest.raises(ValueError, match="groups of 32"):
        Int8Weight(torch.randn(32, 70))


def test_the_kernels_build_and_load():
    """With a compiler present the build must succeed: the tests never skip a broken one."""
    from lucedesk.kernels.cpu_build import load_cpu_ops

    ops = load_cpu_ops()
    assert isinstance(ops.int8_amx_available(), bool)


def test_a_first_build_is_announced(tmp_path, monkeypatch):
    """The CLI and the TUI's loading screen say when a start will compile the kernels."""
    from lucedesk.config import EngineConfig
    from lucedesk.engine.build import kernel_build_notice
    from lucedesk.kernels.cpu_build import library_path

    monkeypatch.setenv("LUCEDESK_KERNEL_CACHE", str(tmp_path))
    assert "first run" in kernel_build_notice(EngineConfig(device="cpu"))
    assert kernel_build_notice(EngineConfig(device="cpu", kernels="torch")) is None
    library_path().parent.mkdir(parents=True)
    library_path().touch()  # as if built
    assert kernel_build_notice(EngineConfig(device="cpu")) is None
