"""K-quant scales held as the file has them (kernels/scales.py, csrc/lowbit.h): a Q4_K
weight's group scales as uint8 factors of float32 super-block scales, 24 bytes per sixteen
channels and group instead of 64, give the bits of the float32 scales they stand for, on
every path, for one weight and for a mixture's experts; factors that do not give the scales
exactly are not taken."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucedesk.engine.models.gguf_blocks import block_levels
from lucedesk.kernels.quantized import GroupedLowBitWeight, LowBitWeight
from lucedesk.kernels.scales import exact_factors
from tests.gguf_writer import random_k_quant
from tests.test_lowbit_weights import PATHS


def q4_k(rows: int, cols: int, seed: int):
    """A random Q4_K weight's (levels, d, m, factors) as torch tensors, [rows, cols]."""
    held = block_levels(random_k_quant(rows, cols, Q.Q4_K, np.random.default_rng(seed)), "Q4_K")
    levels = torch.from_numpy(held.levels).view(rows, cols)
    d, m = (torch.from_numpy(a).view(rows, -1) for a in (held.d, held.m))
    factors = tuple(torch.from_numpy(a).view(rows, -1) for a in held.factors)
    return levels, d, m, factors


@pytest.mark.parametrize("vector", PATHS)
@pytest.mark.parametrize("shape", [(32, 256), (48, 768)])
def test_factors_give_the_bits_of_float_scales(vector, shape):
    levels, d, m, factors = q4_k(*shape, seed=shape[1])
    assert exact_factors(d, m, factors)
    kquant = LowBitWeight(levels, d, m, 4, vector=vector, factors=factors)
    plain = LowBitWeight(levels, d, m, 4, vector=vector)
    assert kquant.d.dtype == torch.uint8 and plain.d.dtype == torch.float32
    assert kquant.nbytes / plain.nbytes == pytest.approx((256 + 48) / (256 + 128))
    assert torch.equal(kquant.dequantize(), plain.dequantize())
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 17):
        x = (torch.randn(rows, shape[1], generator=g) * 3).bfloat16()
        assert torch.equal(kquant(x), plain(x)), rows


@pytest.mark.parametrize("vector", PATHS)
def test_experts_with_factors_give_the_bits_of_float_scales(vector):
    experts, n, k = 6, 64, 512
    held = {kq: GroupedLowBitWeight(experts, (n, k), 4, vector=vector, kquant=kq) for kq in (1, 0)}
    for e in range(experts):
        levels, d, m, factors = q4_k(n, k, seed=e)
        held[1].set(e, levels, d, m, *factors)
        held[0].set(e, levels, d, m)
        assert torch.equal(held[1].dequantize(e), held[0].dequantize(e))
    g = torch.Generator().manual_seed(2)
    for tokens in (1, 5, 16):
        x = torch.randn(tokens, k, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(tokens)])
        rows = torch.arange(tokens).repeat_interleave(3)
        got = held[1](x, ids.reshape(-1), rows)
        assert torch.equal(got, held[0](x, ids.reshape(-1), rows)), tokens


def test_factors_that_are_not_exact_are_not_taken():
    levels, d, m, factors = q4_k(32, 256, seed=3)
    off = (factors[0], factors[1] * 1.5, factors[2], factors[3])
    assert not exact_factors(d, m, off)
    assert LowBitWeight(levels, d, m, 4, factors=off).d.dtype == torch.float32
    grouped = GroupedLowBitWeight(3, (32, 256), 4, kquant=True)
    grouped.set(0, levels, d, m, *factors)
    assert grouped.kquant
    grouped.set(1, levels, d, m, *off)  # all experts' scales become float32 ones
    grouped.set(2, levels, d, m, *factors)
    assert not grouped.kquant
    plain = LowBitWeight(levels, d, m, 4)
    assert all(torch.equal(grouped.dequantize(e), plain.dequantize()) for e in range(3))
    with pytest.raises(ValueError, match="K % 256"):
        GroupedLowBitWeight(2, (32, 96), 4, kquant=True)
    cut = levels[:, :224], d[:, :7], m[:, :7]
    assert not exact_factors(cut[1], cut[2], (factors[0][:, :7], factors[1], *factors[2:]))


@pytest.mark.parametrize("vector", PATHS)
def test_a_mixture_on_k_quant_experts_gives_the_bits_of_float_scales(vector):
    """The one-call mixture (csrc/moe.h) over Q4_K experts holding their factors: the bits
    of the same experts with float32 scales, and of the model's Python path."""
    from lucedesk.engine.models.config import ModelConfig
    from lucedesk.engine.models.moe import MoEBlock
    from lucedesk.kernels.cpu import FusedLayerCalls

    experts, hidden, inter = 8, 256, 256
    c = ModelConfig(
        architecture="qwen3moe", vocab_size=32, hidden_size=hidden, intermediate_size=inter,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=128, num_experts=experts,
        num_experts_per_tok=3, moe_intermediate_size=inter,
    )  # fmt: skip
    block = MoEBlock(c, torch.bfloat16).requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    block.router.copy_(torch.randn(experts, hidden, generator=g))
    held = {}
    for kq in (True, False):
        for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            w = GroupedLowBitWeight(experts, (n, k), 4, vector=vector, kquant=kq)
            for e in range(experts):
                levels, d, m, factors = q4_k(n, k, seed=e * 7 + n)
                w.set(e, levels, d, m, *(factors if kq else ()))
            held[kq, proj] = w
    x = torch.randn(6, hidden, generator=g).bfloat16()
    out = {}
    with torch.inference_mode():
        for kq in (True, False):
            block.experts.quantized = {p: held[kq, p] for p in ("gate_up", "down")}
            block.fused = FusedLayerCalls()
            out[kq] = block(x, None)
            block.fused = None
            assert torch.equal(block(x, None), out[kq])
    assert held[True, "down"].kquant and torch.equal(out[True], out[False])
