"""A layer's halves around attention as one C++ call each (kernels/cpu.py FusedLayerCalls,
csrc/fused.h): bit for bit the separate calls they stand for, on random weights at 4 and 8
bits on every path this machine has (with and without a qkv bias and q/k norms), and in
engines on a 4-bit file and on each family's tiny model, token for token."""

from __future__ import annotations

from dataclasses import astuple

import pytest
import torch
import torch.nn.functional as F

from lucedesk.engine.models.causal_attention import CausalAttention
from lucedesk.engine.models.loader import load_model
from lucedesk.engine.runner import PagedAttention
from lucedesk.kernels.attention_torch import write_kv_torch
from lucedesk.kernels.cpu import FusedLayerCalls, add_rms_norm_cpu, rotary_cpu
from lucedesk.kernels.kv_storage import LayerKV
from lucedesk.kernels.layers_torch import rms_norm
from lucedesk.kernels.metadata import AttentionMetadata
from lucedesk.kernels.quantized import LowBitWeight
from tests.engine_harness import make_engine, random_jobs, run_jobs
from tests.gguf_writer import write_gguf
from tests.test_lowbit_weights import FOUR_BIT, PATHS, random_levels

H, HEADS, KV_HEADS, HD, INTER = 64, 4, 2, 16, 96


def weight(n: int, k: int, bits: int, seed: int, vector: bool) -> LowBitWeight:
    levels, d, m, _ = random_levels(n, k, bits, seed)
    return LowBitWeight(levels, d, m, bits, vector=vector)


@pytest.mark.parametrize("vector", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("first_layer", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_calls_equal_the_separate_calls(vector, bits, tokens, first_layer, family):
    g = torch.Generator().manual_seed(bits * 100 + tokens)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    residual = None if first_layer else torch.randn(tokens, H, generator=g).bfloat16()
    attn_norm, ffn_norm = (torch.rand(H, generator=g).bfloat16() + 0.5 for _ in range(2))
    qkv_w = weight((HEADS + 2 * KV_HEADS) * HD, H, bits, 1, vector)
    bias = torch.randn(qkv_w.shape[0], generator=g).bfloat16() if family == "qwen2" else None
    norms = None
    if family == "qwen3":
        norms = tuple(torch.rand(HD, generator=g).bfloat16() + 0.5 for _ in range(2))
    gate_up, down = weight(2 * INTER, H, bits, 2, vector), weight(H, INTER, 8, 3, vector)
    angles = torch.rand(tokens, HD, generator=g) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    cache_shape = (KV_HEADS, 5, 16, HD)
    slots = torch.randperm(80, generator=g)[:tokens]
    fused = FusedLayerCalls()

    # norm + qkv (+ bias) (+ q/k norms) + rotary + K/V write, as DecoderLayer's separate calls
    h, want_residual = add_rms_norm_cpu(x, residual, attn_norm, 1e-5)
    qkv = qkv_w(h) if bias is None else qkv_w(h) + bias
    q, k, v = qkv.split([HEADS * HD, KV_HEADS * HD, KV_HEADS * HD], dim=-1)
    q, k, v = q.view(tokens, HEADS, HD), k.view(tokens, KV_HEADS, HD), v.view(tokens, KV_HEADS, HD)
    if norms is not None:
        q, k = rms_norm(q, norms[0], 1e-5), rms_norm(k, norms[1], 1e-5)
    rotary_cpu(q, k, cos, sin)
    want_k, want_v = torch.zeros(cache_shape).bfloat16(), torch.zeros(cache_shape).bfloat16()
    write_kv_torch(k, v, want_k, want_v, slots)
    got_k, got_v = torch.zeros(cache_shape).bfloat16(), torch.zeros(cache_shape).bfloat16()
    args = (x, residual, attn_norm, 1e-5, qkv_w, HEADS, KV_HEADS, cos, sin)
    *got, got_residual = fused.attention_input(*args, (got_k, got_v, slots), bias, norms)
    assert all(torch.equal(a, b) for a, b in zip(got, (q, k, v)))
    assert torch.equal(got_residual, want_residual)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    alone = fused.attention_input(*args, None, bias, norms)
    assert all(torch.equal(a, b) for a, b in zip(alone, (q, k, v)))

    # norm + gate|up + SiLU * up + down
    y = torch.randn(tokens, H, generator=g).bfloat16()
    h, want_residual = add_rms_norm_cpu(y, got_residual, ffn_norm, 1e-5)
    gate, up = gate_up(h).chunk(2, dim=-1)
    want = down(F.silu(gate) * up)
    got, got_residual = fused.gated_mlp(y, got_residual, ffn_norm, 1e-5, gate_up, down)
    assert torch.equal(got, want) and torch.equal(got_residual, want_residual)


@pytest.mark.parametrize("vector", PATHS)
def test_the_gated_mlp_equals_silu_then_mul_at_every_magnitude(vector):
    """With the vector kernels silu(gate) * up is made and quantized in one pass (where the
    intermediate size is a multiple of 64, as ATen's vector loop takes whole rows): its bits
    are ATen's silu then mul, from gates of 1e-3 to thousands (exp's overflow and underflow
    included), on one row and on rows the pass splits between threads (160 groups)."""
    fused, inter = FusedLayerCalls(), 128
    for seed, (scale, tokens) in enumerate([(0.01, 1), (1, 7), (30, 40), (300, 5), (3000, 40)]):
        g = torch.Generator().manual_seed(seed)
        gate_up, down = weight(2 * inter, H, 4, seed, vector), weight(H, inter, 4, 9, vector)
        y, residual = (torch.randn(tokens, H, generator=g).bfloat16() for _ in range(2))
        norm = (torch.rand(H, generator=g) * scale).bfloat16()
        h, _ = add_rms_norm_cpu(y, residual, norm, 1e-5)
        gate, up = gate_up(h).chunk(2, dim=-1)
        want = down(F.silu(gate) * up)
        got, _ = fused.gated_mlp(y, residual, norm, 1e-5, gate_up, down)
        assert torch.equal(got, want), (scale, tokens)
        assert gate.float().abs().max() > scale / 20  # the magnitudes reached the gates


def test_fused_calls_refuse_what_they_cannot_take():
    fused = FusedLayerCalls()
    w = weight((HEADS + 2 * KV_HEADS) * HD, H, 4, 1, PATHS[-1])
    table = torch.zeros(1, HD).bfloat16()
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        fused.attention_input(torch.randn(1, H), None, torch.ones(H), 1e-5, w, 4, 2, table, table)
    x, norm = torch.randn(1, H).bfloat16(), torch.ones(H).bfloat16()
    with pytest.raises(RuntimeError, match="heads \\+ 2 kv heads"):
        fused.attention_input(x, None, norm, 1e-5, w, 5, 2, table, table)
    cache = torch.zeros(KV_HEADS, 1, 16, HD).bfloat16()
    with pytest.raises(RuntimeError, match="slot 16 out of range"):
        fused.attention_input(x, None, norm, 1e-5, w, 4, 2, table, table,
                              (cache, cache.clone(), torch.tensor([16])))  # fmt: skip
    with pytest.raises(RuntimeError, match="q and k norms come together"):
        fused.attention_input(x, None, norm, 1e-5, w, 4, 2, table, table, None, None,
                              (torch.ones(HD).bfloat16(), None))  # fmt: skip
    assert not fused.accepts(w, torch.zeros(2, 2))


@pytest.fixture(scope="module")
def four_bit_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("q4") / "q4.gguf", FOUR_BIT)


def fused_layers(model) -> list[tuple[object, object]]:
    """Each layer's fused halves: attention input, and the dense MLP's or the experts'."""
    return [
        (layer.fused_input, layer.fused_mlp if layer.moe is None else layer.moe.fused)
        for layer in model.layers
    ]


def without_fused_calls(model) -> None:
    model.stack = None
    for layer in model.layers:
        layer.fused_input = layer.fused_mlp = None
        if layer.moe is not None:
            layer.moe.fused = None


def test_an_engine_on_fused_calls_gives_the_tokens_of_separate_calls(four_bit_gguf):
    """Prompt chunks, decodes, preemption: every step through the fused calls gives the
    tokens the separate calls give; the model's forward alone gives the same hidden states."""
    loaded = load_model(four_bit_gguf, torch.bfloat16)
    jobs = random_jobs(loaded, 6, 9, prompt_range=(1, 90), output_range=(4, 30))
    engine = make_engine(loaded, kernels="cpu", weights="q4", max_slots=4, kv_pool_tokens=4096)
    calls = fused_layers(loaded.model)
    assert all(a and b for a, b in calls), "the 4-bit layers take the fused calls"
    assert loaded.model.stack is not None, "...and the model runs them as one stack"
    fused_tokens = run_jobs(engine, jobs)
    ids = torch.randint(0, loaded.config.vocab_size, (19,), generator=torch.Generator())
    with torch.inference_mode():
        fused_hidden = loaded.model(ids, torch.arange(19), CausalAttention(loaded.config))
        without_fused_calls(loaded.model)
        separate_hidden = loaded.model(ids, torch.arange(19), CausalAttention(loaded.config))
    engine = make_engine(loaded, kernels="cpu", weights="q4", max_slots=4, kv_pool_tokens=4096)
    loaded.model.stack = None  # the fused calls layer by layer
    assert run_jobs(engine, jobs) == fused_tokens
    engine = make_engine(loaded, kernels="cpu", weights="q4", max_slots=4, kv_pool_tokens=4096)
    without_fused_calls(loaded.model)
    assert run_jobs(engine, jobs) == fused_tokens
    assert torch.equal(fused_hidden, separate_hidden)


def random_caches(caches, g: torch.Generator) -> None:
    """Every cache row random: the context the step's rows attend to."""
    for kv in caches:
        for t in (kv.k, kv.v):
            if t.dtype == torch.int8:
                t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
            else:
                t.copy_(torch.randn(t.shape, generator=g))
        for s in (kv.k_scale, kv.v_scale):
            if s is not None:
                s.copy_(torch.rand(s.shape, generator=g) * 0.05)


@pytest.mark.parametrize("kv_dtype", ["dtype", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss"])
def test_the_layer_stack_gives_the_bits_of_the_calls_layer_by_layer(tiny_models, arch, kv_dtype):
    """A step of two decodes beside two prompt chunks (one fresh, one continuing), and a
    step of decodes only, one with a three-token draft; a window and sinks on the first
    layer: the stack's hidden states and every cache row it writes are those of the
    per-layer calls (Gemma 3's: float32 norms, norms after attention and the MLP, tanh
    GELU, sliding layers on their own rotary table; Qwen3-MoE's experts beside a dense
    layer, gpt-oss's biased experts with the clamped SwiGLU). The per-layer calls run the
    mixtures through the model's Python (router, grouped passes, weighted sum)."""
    loaded = load_model(tiny_models[arch], torch.bfloat16)
    make_engine(loaded, kernels="cpu", weights="int8", max_slots=4, kv_pool_tokens=2048,
                kv_dtype=kv_dtype)  # fmt: skip
    runner_model = loaded.model
    first = runner_model.layers[0]
    first.window = 9
    if first.sinks is None:  # gpt-oss has its own
        first.sinks = torch.randn(loaded.config.num_heads)
    runner_model.use_kernels(runner_model.kernels)  # the stack takes the window and sinks
    stack = runner_model.stack
    assert stack is not None
    g = torch.Generator().manual_seed(len(arch))
    block_size, kv_heads, hd = 16, loaded.config.num_kv_heads, loaded.config.head_dim
    shape = (kv_heads, 40, block_size, hd)
    layers = loaded.config.num_layers
    caches = [LayerKV.allocate(shape, torch.bfloat16, kv_dtype, "cpu") for _ in range(layers)]
    random_caches(caches, g)
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    kernels = runner_model.kernels
    steps = [([1, 1, 20, 17], [30, 45, 20, 57], 2), ([1, 4], [30, 45], 2)]
    for query_lens, seq_lens, num_decodes in steps:
        meta = AttentionMetadata.build(
            query_lens, seq_lens, tables[: len(query_lens)], block_size, num_decodes
        )
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
        ids = torch.randint(0, loaded.config.vocab_size, (len(positions),), generator=g)
        assert stack.takes(torch.empty(1).bfloat16(), caches, meta)
        results = []
        for use_stack in (True, False):
            runner_model.stack = stack if use_stack else None
            for layer in runner_model.layers:
                if layer.moe is not None:  # the Python mixture, not the one-call one
                    layer.moe.fused = kernels.fused if use_stack else None
            step_caches = [LayerKV(*(None if t is None else t.clone() for t in astuple(kv)))
                           for kv in caches]  # fmt: skip
            attention = PagedAttention(kernels, step_caches, meta, loaded.config.attention_scale)
            with torch.inference_mode():
                results.append((runner_model(ids, positions, attention), step_caches))
        (hidden, stacked), (want_hidden, layered) = results
        assert torch.equal(hidden, want_hidden)
        for a, b in zip(stacked, layered):
            assert all(torch.equal(x, y) for x, y in zip(astuple(a), astuple(b)) if x is not None)


def test_the_layer_stack_refuses_what_it_cannot_take(tiny_models):
    """A bad call is a clear error, not a crash: rows that are not the step's, an 8-bit
    cache without its scales."""
    loaded = load_model(tiny_models["llama"], torch.bfloat16)
    make_engine(loaded, kernels="cpu", weights="int8", max_slots=2, kv_pool_tokens=256)
    stack, c = loaded.model.stack, loaded.config
    shape = (c.num_kv_heads, 4, 16, c.head_dim)
    caches = [LayerKV.allocate(shape, torch.bfloat16, "dtype", "cpu") for _ in range(2)]
    meta = AttentionMetadata.build([1], [5], [[0]], 16, 1)
    table = torch.zeros(1, c.head_dim).bfloat16()
    x = torch.randn(2, c.hidden_size).bfloat16()
    with pytest.raises(RuntimeError, match="hold 1 rows, x 2"):
        stack(x, (table,) * 4, caches, meta, 0.25)
    caches[1] = LayerKV.allocate(shape, torch.bfloat16, "int8", "cpu")
    caches[1].k_scale = None
    with pytest.raises(RuntimeError, match="int8 cache takes k and v scales"):
        stack(x[:1], (table,) * 4, caches, meta, 0.25)


# Which halves each family's tiny model fuses: qkv bias (qwen2) and q/k norms (qwen3) in the
# first; a mixture's experts (qwen3moe, gpt-oss) in the second; Gemma 3's float32 norms
# neither; gpt-oss's attention (sinks, 16-wide heads) stays layer by layer.
FAMILIES = {
    "llama": (True, True),
    "qwen2": (True, True),
    "qwen3": (True, True),
    "qwen3moe": (True, True),
    "gpt-oss": (None, True),
    "gemma3": (False, False),
}


@pytest.mark.parametrize(
    "arch,kv_dtype", [(a, "dtype") for a in sorted(FAMILIES)] + [("qwen3", "int8")]
)
def test_each_family_fuses_what_it_can_with_the_tokens_of_separate_calls(
    tiny_models, arch, kv_dtype
):
    """With an 8-bit cache the fused half leaves the K/V write to the cache's own."""
    loaded = load_model(tiny_models[arch], torch.bfloat16)
    jobs = random_jobs(loaded, 4, 3, prompt_range=(1, 60), output_range=(4, 16), pressure=False)
    config = dict(
        kernels="cpu", weights="int8", max_slots=4, kv_pool_tokens=2048, kv_dtype=kv_dtype
    )
    engine = make_engine(loaded, **config)
    want_input, want_mlp = FAMILIES[arch]
    calls = fused_layers(loaded.model)
    if want_input is not None:
        assert all((a is not None) == want_input for a, _ in calls)
    assert all((b is not None) == want_mlp for _, b in calls)
    fused_tokens = run_jobs(engine, jobs)
    engine = make_engine(loaded, **config)
    without_fused_calls(loaded.model)
    assert run_jobs(engine, jobs) == fused_tokens
