"""A dense layer's halves as one C++ call each (kernels/cpu.py FusedLayerCalls,
csrc/fused.h): bit for bit the separate calls they stand for, on random weights at 4 and 8
bits on every path this machine has, and in an engine on a 4-bit file, token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lucedesk.engine.models.decoder import CausalAttention
from lucedesk.engine.models.loader import load_model
from lucedesk.kernels.attention_torch import write_kv_torch
from lucedesk.kernels.cpu import FusedLayerCalls, add_rms_norm_cpu, rotary_cpu
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
def test_fused_calls_equal_the_separate_calls(vector, bits, tokens, first_layer):
    g = torch.Generator().manual_seed(bits * 100 + tokens)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    residual = None if first_layer else torch.randn(tokens, H, generator=g).bfloat16()
    attn_norm, ffn_norm = (torch.rand(H, generator=g).bfloat16() + 0.5 for _ in range(2))
    qkv_w = weight((HEADS + 2 * KV_HEADS) * HD, H, bits, 1, vector)
    gate_up, down = weight(2 * INTER, H, bits, 2, vector), weight(H, INTER, 8, 3, vector)
    angles = torch.rand(tokens, HD, generator=g) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    cache_shape = (KV_HEADS, 5, 16, HD)
    slots = torch.randperm(80, generator=g)[:tokens]
    fused = FusedLayerCalls()

    # norm + qkv + rotary + K/V write
    h, want_residual = add_rms_norm_cpu(x, residual, attn_norm, 1e-5)
    want = qkv_w(h)
    q, k, v = want.split([HEADS * HD, KV_HEADS * HD, KV_HEADS * HD], dim=-1)
    rotary_cpu(q.view(tokens, HEADS, HD), k.view(tokens, KV_HEADS, HD), cos, sin)
    want_k, want_v = torch.zeros(cache_shape).bfloat16(), torch.zeros(cache_shape).bfloat16()
    k3, v3 = k.view(tokens, KV_HEADS, HD), v.view(tokens, KV_HEADS, HD)
    write_kv_torch(k3, v3, want_k, want_v, slots)
    got_k, got_v = torch.zeros(cache_shape).bfloat16(), torch.zeros(cache_shape).bfloat16()
    got, got_residual = fused.attention_input(
        x, residual, attn_norm, 1e-5, qkv_w, HEADS, KV_HEADS, cos, sin, (got_k, got_v, slots)
    )
    assert torch.equal(got, want) and torch.equal(got_residual, want_residual)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    alone, _ = fused.attention_input(x, residual, attn_norm, 1e-5, qkv_w, HEADS, KV_HEADS, cos, sin)
    assert torch.equal(alone, want)

    # norm + gate|up + SiLU * up + down
    y = torch.randn(tokens, H, generator=g).bfloat16()
    h, want_residual = add_rms_norm_cpu(y, got_residual, ffn_norm, 1e-5)
    gate, up = gate_up(h).chunk(2, dim=-1)
    want = down(F.silu(gate) * up)
    got, got_residual = fused.gated_mlp(y, got_residual, ffn_norm, 1e-5, gate_up, down)
    assert torch.equal(got, want) and torch.equal(got_residual, want_residual)


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
    assert not fused.accepts(w, torch.zeros(2, 2))


@pytest.fixture(scope="module")
def four_bit_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("q4") / "q4.gguf", FOUR_BIT)


def test_an_engine_on_fused_calls_gives_the_tokens_of_separate_calls(four_bit_gguf):
    """Prompt chunks, decodes, preemption: every step through the fused calls gives the
    tokens the separate calls give; the model's forward alone gives the same hidden states."""
    loaded = load_model(four_bit_gguf, torch.bfloat16)
    jobs = random_jobs(loaded, 6, 9, prompt_range=(1, 90), output_range=(4, 30))
    engine = make_engine(loaded, kernels="cpu", weights="q4", max_slots=4, kv_pool_tokens=4096)
    layers = loaded.model.layers
    calls = [layer.fused for layer in layers]
    assert all(c is not None for c in calls), "the 4-bit layers take the fused calls"
    fused_tokens = run_jobs(engine, jobs)
    ids = torch.randint(0, loaded.config.vocab_size, (19,), generator=torch.Generator())
    with torch.inference_mode():
        fused_hidden = loaded.model(ids, torch.arange(19), CausalAttention(loaded.config))
        for layer in layers:
            layer.fused = None
        separate_hidden = loaded.model(ids, torch.arange(19), CausalAttention(loaded.config))
    engine = make_engine(loaded, kernels="cpu", weights="q4", max_slots=4, kv_pool_tokens=4096)
    for layer in layers:
        layer.fused = None
    assert run_jobs(engine, jobs) == fused_tokens
    assert torch.equal(fused_hidden, separate_hidden)
