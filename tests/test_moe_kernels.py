"""The experts' matmuls: the grouped C++ low-bit pass (4-bit, MXFP4 through its level table,
6-bit, 8-bit) gives each row exactly what its expert's weight alone gives it; the file's MXFP4 and
Q8_0 blocks are held exactly; the Triton grouped GEMM (in its interpreter here) equals the
torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from lucedesk.engine.models.config import ModelConfig
from lucedesk.engine.models.gguf_blocks import block_levels
from lucedesk.engine.models.moe import MoEBlock, gated
from lucedesk.kernels.cpu import FusedLayerCalls
from lucedesk.kernels.moe_torch import grouped_linear_torch
from lucedesk.kernels.moe_triton import grouped_linear
from lucedesk.kernels.quantized import (
    MXFP4_LEVELS,
    GroupedLowBitWeight,
    LowBitWeight,
    lowbit_vector_available,
)
from tests.kernel_cases import DEVICE, TOL
from tests.test_lowbit_weights import random_six_bit

PATHS = [False, True] if lowbit_vector_available() else [False]
FORMATS = [(4, None), (4, MXFP4_LEVELS), (8, None)]


def random_experts(num: int, n: int, k: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 2**bits, (num, n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(num, n, k // 32, generator=g) * 0.01
    m = -torch.rand(num, n, k // 32, generator=g) * 0.05
    return levels, d, m, g


@pytest.mark.parametrize("bits,table", FORMATS)
@pytest.mark.parametrize("pairs", [(20, 5, 2), (7, 5, 1), (1, 5, 4), (33, 3, 3)])
def test_grouped_pairs_equal_their_expert_alone(bits, table, pairs):
    """Tokens x top-k pairs over a few experts (some never chosen, some by every token):
    each pair's output equals its row times its expert's weight alone, bit for bit, with the
    rows shared by pairs (gate/up) or one a pair (down)."""
    num_tokens, num_experts, per_token = pairs
    n, k = 96, 128
    levels, d, m, g = random_experts(num_experts, n, k, bits, num_tokens + bits)
    x = torch.randn(num_tokens, k, generator=g).bfloat16()
    ids = torch.stack(
        [torch.randperm(num_experts, generator=g)[:per_token] for _ in range(num_tokens)]
    )
    if num_tokens > 1:
        ids[-1] = ids[0]  # two tokens with the same experts
    experts = ids.reshape(-1)
    rows = torch.arange(num_tokens).repeat_interleave(per_token)
    for vector in PATHS:
        grouped = GroupedLowBitWeight(num_experts, (n, k), bits, table, vector=vector)
        for e in range(num_experts):
            grouped.set(e, levels[e], d[e], m[e])
        shared = grouped(x, experts, rows)
        own = grouped(x[rows], experts)
        assert torch.equal(shared, own)
        for e in range(num_experts):
            alone = LowBitWeight(levels[e], d[e], m[e], bits, vector=vector, table=table)
            assert torch.equal(grouped.dequantize(e), alone.dequantize())
            chosen = (experts == e).nonzero().flatten()
            if len(chosen):
                assert torch.equal(shared[chosen], alone(x[rows[chosen]]))


def test_a_level_table_is_looked_up():
    """A 4-bit weight with a table multiplies by the table's levels: the same result as the
    looked-up levels held at 8 bits."""
    n, k = 32, 64
    levels, d, m, g = random_experts(1, n, k, 4, 3)
    x = torch.randn(5, k, generator=g).bfloat16()
    table = LowBitWeight(levels[0], d[0], m[0], 4, table=MXFP4_LEVELS)
    looked_up = torch.tensor(MXFP4_LEVELS, dtype=torch.uint8)[levels[0].long()]
    eight = LowBitWeight(looked_up, d[0], m[0], 8)
    assert torch.equal(table.levels(), looked_up)
    assert torch.equal(table(x), eight(x))


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.Q8_0])
def test_file_blocks_are_held_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    values[5, :32] = 0  # an all-zero block
    blocks = quants.quantize(values, qtype)
    want = quants.dequantize(blocks, qtype)
    lv = block_levels(blocks.reshape(-1), qtype.name)
    shape = values.shape
    held = LowBitWeight(
        torch.from_numpy(lv.levels).view(shape),
        torch.from_numpy(lv.d).view(shape[0], -1),
        torch.from_numpy(lv.m).view(shape[0], -1),
        lv.bits,
        table=lv.table,
    )
    assert torch.equal(held.dequantize(), torch.from_numpy(want))


def test_grouped_weights_refuse_what_they_cannot_run():
    grouped = GroupedLowBitWeight(3, (32, 64), 4)
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="one row per pair"):
        grouped(x, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="expert 3 out of range"):
        grouped(x, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(RuntimeError, match="row out of range"):
        grouped(x, torch.tensor([0, 1]), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="bfloat16"):
        grouped(x.float(), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="a level table is for 4-bit"):
        GroupedLowBitWeight(3, (32, 64), 8, MXFP4_LEVELS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 33, 1], [0, 0, 0, 2], [16, 16, 0, 17]])
def test_triton_grouped_linear_matches_reference(dtype, counts):
    g = torch.Generator().manual_seed(len(counts) + sum(counts))
    n, k = 80, 72  # neither a multiple of the kernel's tiles
    weight = torch.randn(len(counts), n, k, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(sum(counts), k, generator=g).to(dtype).to(DEVICE)
    c = torch.tensor(counts, device=DEVICE)
    got = grouped_linear(x, weight, c)
    want = grouped_linear_torch(x.float(), weight.float(), c)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])


def test_triton_grouped_linear_checks_its_inputs():
    w = torch.randn(2, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="do not agree"):
        grouped_linear(torch.randn(3, 16, device=DEVICE), w, torch.tensor([1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="counts must be"):
        grouped_linear(torch.randn(3, 32, device=DEVICE), w, torch.tensor([3], device=DEVICE))


def per_expert_reference(block, x: torch.Tensor, weights: dict[str, list]) -> torch.Tensor:
    """Each row alone, each of its experts alone (its own LowBitWeight), the weighted sum in
    the router's rank order: what a mixture means, with no grouping and no batch."""
    c = block.c
    out = []
    for row in x.split(1):
        w, ids = block.route(row)
        total = None
        for j, e in enumerate(ids[0].tolist()):
            h = weights["gate_up"][e](row)
            if block.experts.gate_up_bias is not None:
                h = h + block.experts.gate_up_bias[e]
            y = weights["down"][e](gated(c, h).contiguous())
            if block.experts.down_bias is not None:
                y = y + block.experts.down_bias[e]
            term = y * w[:, j : j + 1]
            total = term if total is None else total + term
        out.append(total)
    return torch.cat(out)


def assert_one_call_is_both(block, x: torch.Tensor, alone: dict[str, list]) -> None:
    """The C++ mixture in one call (csrc/moe.h), the model's Python path and every row alone
    with each expert's weight alone (`per_expert_reference`) give the same bits, not all
    zero."""
    with torch.inference_mode():
        python = block(x, None)
        block.fused = FusedLayerCalls()
        one_call = block(x, None)
        reference = per_expert_reference(block, x, alone)
    assert torch.equal(one_call, python)
    assert torch.equal(one_call, reference)
    assert one_call.abs().max() > 0


def random_mixture(c: ModelConfig, bits: int, table, vector: bool, seed: int, bias_scale=0.1):
    """A one-layer MoEBlock of config `c` with random router, biases (where `c` has them)
    and experts held as `bits`-bit levels, and each expert's weights alone (LowBitWeight)."""
    block = MoEBlock(c, torch.bfloat16).requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    block.router.copy_(torch.randn(c.num_experts, c.hidden_size, generator=g))
    for bias in (block.router_bias, block.experts.gate_up_bias, block.experts.down_bias):
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=g) * bias_scale)
    alone: dict[str, list] = {}
    inter, hidden = c.moe_intermediate_size, c.hidden_size
    for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        levels, d, m, _ = random_experts(c.num_experts, n, k, bits, seed * 7 + n)
        held = GroupedLowBitWeight(c.num_experts, (n, k), bits, table, vector=vector)
        alone[proj] = []
        for e in range(c.num_experts):
            held.set(e, levels[e], d[e], m[e])
            alone[proj].append(LowBitWeight(levels[e], d[e], m[e], bits, vector, table))
        block.experts.quantized[proj] = held
    return block, alone


MOE_CASES = 16


@pytest.mark.parametrize("case", range(MOE_CASES))
def test_the_one_call_mixture_equals_the_per_expert_path(case):
    """Randomized (experts 8-128, top-k 1-8, rows 1-16, 4-bit, MXFP4 and 8-bit experts,
    SiLU, tanh GELU and gpt-oss's clamped SwiGLU, either kernel path, biases or none, either
    router; SiLU and the clamped SwiGLU on the vector path with 64 or 128 intermediate
    outputs take the one pass that makes and quantizes act(gate) * up, the gate|up bias
    added in it): the C++ mixture in one call (csrc/moe.h), the model's Python path (router,
    grouped passes, weighted sum) and every row computed alone with each expert's weight
    alone give the same bits (float32 sums over bfloat16 activations)."""
    rng = np.random.default_rng(case)
    num_experts = int(rng.choice([8, 16, 32, 64, 128]))
    top_k = int(rng.integers(1, 9))
    rows = int(rng.integers(1, 17))
    bits, table = FORMATS[int(rng.integers(len(FORMATS)))]
    act = ("silu", "gelu_tanh", "swiglu_clamped")[int(rng.integers(3))]
    vector = PATHS[int(rng.integers(2)) % len(PATHS)]
    hidden, inter = 64, int(rng.choice([32, 64, 128]))
    c = ModelConfig(
        architecture="gpt-oss" if act == "swiglu_clamped" else "qwen3moe",
        vocab_size=32, hidden_size=hidden, intermediate_size=inter, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=32, num_experts=num_experts,
        num_experts_per_tok=min(top_k, num_experts), moe_intermediate_size=inter,
        hidden_act=act, router="topk_softmax" if case % 4 == 3 else "softmax_topk",
        norm_topk_prob=bool(case % 2), expert_bias=bool(case % 5 < 2),
        swiglu_limit=float(rng.uniform(0.5, 7.0)),
    )  # fmt: skip
    block, alone = random_mixture(c, bits, table, vector, case)
    g = torch.Generator().manual_seed(1000 + case)
    x = (torch.randn(rows, hidden, generator=g) * 2).bfloat16()
    assert_one_call_is_both(block, x, alone)


@pytest.mark.parametrize("vector", PATHS)
@pytest.mark.parametrize("act", ["silu", "swiglu_clamped"])
def test_the_gated_pass_has_atens_bits_at_every_magnitude(act, vector):
    """The one pass that makes and quantizes a mixture's act(gate) * up (with the gate|up
    bias; the vector path's, the plain path runs ATen's ops) gives the bits of ATen's ops
    from gates of ~1e-3 to thousands: the clamped SwiGLU's limit reached on both sides,
    exp's overflow and underflow, rows of 1-16."""
    hidden, inter = 64, 128
    c = ModelConfig(
        architecture="gpt-oss" if act == "swiglu_clamped" else "qwen3moe", vocab_size=32,
        hidden_size=hidden, intermediate_size=inter, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=4,
        moe_intermediate_size=inter, hidden_act=act, router="softmax_topk",
        norm_topk_prob=True, expert_bias=True, swiglu_limit=6.97,
    )  # fmt: skip
    for seed, (scale, rows) in enumerate([(0.01, 1), (1, 7), (30, 16), (300, 5), (3000, 16)]):
        block, alone = random_mixture(c, 4, None, vector, seed, bias_scale=scale / 10)
        g = torch.Generator().manual_seed(1000 + seed)
        x = (torch.randn(rows, hidden, generator=g) * scale).bfloat16()
        assert_one_call_is_both(block, x, alone)
        every = torch.arange(8).repeat(rows)
        gate_up = block.experts.quantized["gate_up"](
            x, every, torch.arange(rows).repeat_interleave(8)
        )
        assert gate_up.float().abs().max() > scale / 20  # the magnitudes reached the gates


@pytest.mark.parametrize("vector", PATHS)
def test_six_bit_experts_are_what_each_gives_alone(vector):
    """Q6_K experts (a Q4_K_M file's down in some layers), held at 6 bits: the grouped pass
    gives each pair what its expert alone gives, and the one-call mixture the Python path's
    and the per-expert reference's bits."""
    num_experts, top_k, hidden, inter = 16, 4, 256, 256
    c = ModelConfig(
        architecture="qwen3moe", vocab_size=32, hidden_size=hidden, intermediate_size=inter,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=num_experts,
        num_experts_per_tok=top_k, moe_intermediate_size=inter, hidden_act="silu",
        router="softmax_topk", norm_topk_prob=True,
    )  # fmt: skip
    block = MoEBlock(c, torch.bfloat16).requires_grad_(False)
    g = torch.Generator().manual_seed(6)
    block.router.copy_(torch.randn(num_experts, hidden, generator=g))
    alone: dict[str, list] = {}
    for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        held = GroupedLowBitWeight(num_experts, (n, k), 6, vector=vector)
        alone[proj] = []
        for e in range(num_experts):
            levels, d, m, factors, _ = random_six_bit(n, k, 100 * e + n)
            held.set(e, levels, d, m, *factors)
            alone[proj].append(LowBitWeight(levels, d, m, 6, vector, factors=factors))
            assert torch.equal(held.dequantize(e), alone[proj][-1].dequantize())
        held.compact()  # (nothing to compact at 6 bits)
        assert held.d.dtype == torch.int8 and held.nbytes <= num_experts * n * k * 0.83
        block.experts.quantized[proj] = held
    x = (torch.randn(9, hidden, generator=g) * 2).bfloat16()
    ids = torch.tensor([3, 1, 3, 7, 0, 2, 2, 5, 1, 15, 15, 3])
    rows = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 8, 7, 8])
    pairs = block.experts.quantized["gate_up"](x, ids, rows)
    for p, (e, r) in enumerate(zip(ids.tolist(), rows.tolist(), strict=True)):
        assert torch.equal(pairs[p], alone["gate_up"][e](x[r : r + 1])[0])
    assert_one_call_is_both(block, x, alone)


def test_the_one_call_mixture_refuses_what_it_cannot_take():
    held = GroupedLowBitWeight(8, (64, 64), 4)
    down = GroupedLowBitWeight(8, (64, 32), 4)
    router = torch.randn(8, 64)
    fused = FusedLayerCalls()
    x = torch.randn(2, 64).bfloat16()
    args = (router, held, down, (None, None, None), 2, False, 7.0, 1.702)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        fused.moe_mlp(x.float(), "silu", *args)
    with pytest.raises(RuntimeError, match="top_k must be 1..experts"):
        fused.moe_mlp(x, "silu", router, held, down, (None, None, None), 9, False, 7.0, 1.7)
    with pytest.raises(RuntimeError, match="router must be float32"):
        fused.moe_mlp(x, "silu", router.bfloat16(), *args[1:])
    with pytest.raises(RuntimeError, match="not relu"):
        fused.moe_mlp(x, "relu", *args)
    for biases in [
        (None, torch.zeros(8, 32).bfloat16(), None),
        (None, None, torch.zeros(8, 65).bfloat16()),
    ]:
        with pytest.raises(RuntimeError, match="expert biases are bfloat16 \\[experts, outputs\\]"):
            fused.moe_mlp(x, "silu", router, held, down, biases, 2, False, 7.0, 1.7)
    levels, d, m, _ = random_experts(1, 64, 64, 4, 0)
    assert not fused.accepts_experts(held, LowBitWeight(levels[0], d[0], m[0], 4))
    assert not fused.accepts_experts(held, GroupedLowBitWeight(8, (64, 32), 4, vector=False))


@pytest.mark.parametrize("vector", PATHS)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.MXFP4])
def test_experts_keep_float16_scales_where_the_file_has_them(vector, qtype):
    """Q8_0's scales are float16 values and MXFP4's powers of two (with m = -12 d): held so
    (compact: float16, exponent bytes), the experts give the bits of float32 scales for fewer
    bytes; random float32 scales stay float32."""
    experts, n, k = 4, 32, 128
    rng = np.random.default_rng(int(qtype))
    held = {}
    for compact in (True, False):
        for e in range(experts):
            w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            blocks = quants.quantize(w, qtype)
            lv = block_levels(blocks.reshape(-1), qtype.name)
            if e == 0:
                grouped = GroupedLowBitWeight(experts, (n, k), lv.bits, lv.table, vector=vector)
            parts = (torch.from_numpy(lv.levels).view(n, k),) + tuple(
                torch.from_numpy(a).view(n, -1) for a in (lv.d, lv.m)
            )
            grouped.set(e, *parts)
        if compact:
            grouped.compact()
        held[compact] = grouped
        rng = np.random.default_rng(int(qtype))  # the same weights again
    compact = torch.float8_e8m0fnu if qtype == Q.MXFP4 else torch.float16
    assert held[True].d.dtype == compact and held[False].d.dtype == torch.float32
    assert held[True].nbytes <= experts * n * k * (0.532 if qtype == Q.MXFP4 else 1.125)
    for e in range(experts):
        assert torch.equal(held[True].dequantize(e), held[False].dequantize(e))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids = torch.tensor([0, 3, 1, 1, 2, 0, 3, 2, 1, 0])
    rows = torch.arange(5).repeat_interleave(2)
    assert torch.equal(held[True](x, ids, rows), held[False](x, ids, rows))
    noisy = GroupedLowBitWeight(2, (n, k), 8)
    levels, d, m, _ = random_experts(2, n, k, 8, 0)
    for e in range(2):
        noisy.set(e, levels[e], d[e], m[e])
    noisy.compact()
    assert noisy.d.dtype == torch.float32
