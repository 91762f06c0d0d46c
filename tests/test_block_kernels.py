"""GGUF blocks held for the GPU (kernels/blocks.py) and multiplied by the Triton kernels
(kernels/blocks_triton.py), in Triton's interpreter on a CPU: the planes hold each block's
values bit for bit as llama.cpp's definitions (the gguf package's decoders) give them, and
every matmul equals the torch product of those values within fp32 rounding, in fp32 and in
the half types (where the weights are rounded to the dtype before the dot, as on a GPU).

The interpreter computes bf16 dots in fp32 on values rounded to bf16 first (the same
products a GPU's bf16 matrix instructions make exactly, summed in another order), and runs
the GPU's own tiles here as well as its wider ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from lucedesk.catalog.held_formats import BLOCK_TYPES
from lucedesk.kernels.block_weights import BlockWeight, GroupedBlockWeight
from lucedesk.kernels.blocks import Planes, dequantize_planes, planes_from_blocks, q8_0_planes
from lucedesk.kernels.blocks_triton import Tiles
from tests.test_held_formats import random_blocks

GPU_DECODE = Tiles(16, 32, 32, 4)  # split K four ways, as a GPU's decode does for small N
GPU_PROMPT = Tiles(64, 64, 32, 1, 8)
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def planes(kind: str, n: int, k: int, seed: int = 0) -> Planes:
    return planes_from_blocks(random_blocks(kind, n, k, seed), kind, n, k)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in fp32, the weight rounded to x's dtype first (a GPU's dot inputs)."""
    return x.float() @ weight.to(x.dtype).float().T


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.abs().max().clamp(min=1e-6)
    assert got.dtype == dtype
    assert ((got.float() - want).abs().max() / scale) <= TOL[dtype], "beyond rounding"


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_planes_hold_each_blocks_values_bit_for_bit(kind):
    n, k = 48, 768
    raw = random_blocks(kind, n, k, seed=3)
    want = quants.dequantize(raw.reshape(n, -1), Q[kind]).reshape(n, k)
    got = dequantize_planes(planes_from_blocks(raw, kind, n, k)).numpy()
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_any_weight_is_held_as_llama_cpps_q8_0():
    w = torch.randn(32, 96) * 0.1
    raw = quants.quantize(w.numpy(), Q.Q8_0)
    want = quants.dequantize(raw, Q.Q8_0)
    assert np.array_equal(dequantize_planes(q8_0_planes(w)).numpy(), want)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_matmul_equals_the_product_of_the_blocks_values(kind, dtype):
    """Decode rows and a prompt's, at the interpreter's tiles and a GPU's (K split in
    four for the decode), an N that is no multiple of any tile; where the type's blocks
    are 32 values, a K that is no multiple of the interpreter's 256-input step."""
    n, k = 80, 1024 if kind in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS") else 1056
    p = planes(kind, n, k, seed=len(kind))
    weight = BlockWeight([p])
    values = dequantize_planes(p)
    g = torch.Generator().manual_seed(7)
    for rows, tiles in ((1, None), (5, GPU_DECODE), (40, None), (40, GPU_PROMPT)):
        x = torch.randn(rows, k, generator=g).to(dtype)
        close(weight(x, tiles), reference(x, values), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [None, GPU_DECODE])
def test_a_decode_rows_result_does_not_depend_on_its_batch(dtype, tiles):
    """Up to sixteen rows share one tile and K splits by the weight's shape alone, summed
    in order: a row's result is the same bits whatever the other rows hold and however
    many there are. (Kept at its place in the tile: numpy's matmul, which the interpreter
    dots with, sums a row differently at another place; a GPU's dot does not.)"""
    weight = BlockWeight([planes("Q4_K", 64, 512)])
    x = torch.randn(16, 512).to(dtype)
    together = weight(x, tiles)
    others = torch.randn(16, 512).to(dtype)
    for i in (0, 7, 15):
        fewer = weight(x[: i + 1], tiles)
        changed = weight(torch.cat([others[:i], x[i : i + 1], others[i + 1 :]]), tiles)
        assert torch.equal(fewer[i], together[i]) and torch.equal(changed[i], together[i])


def test_runs_of_other_types_write_their_own_columns():
    """q|k in Q4_K and v in Q6_K (a Q4_K_M file's attention) as two runs of one weight."""
    q_k, v = planes("Q4_K", 96, 512), planes("Q6_K", 32, 512, seed=1)
    weight = BlockWeight([q_k, v])
    assert weight.shape == (128, 512)
    x = torch.randn(3, 512).bfloat16()
    values = torch.cat([dequantize_planes(q_k), dequantize_planes(v)])
    close(weight(x), reference(x, values), torch.bfloat16)
    assert weight.gated(x, Activation("silu")) is None  # halves of two types: apart


class Activation:
    """What a gated launch reads of a family's config."""

    def __init__(self, act: str, limit: float = 7.0, alpha: float = 1.702) -> None:
        self.hidden_act, self.swiglu_limit, self.swiglu_alpha = act, limit, alpha


def gated_reference(h: torch.Tensor, c: Activation, dtype: torch.dtype) -> torch.Tensor:
    """The families' gated activation on gate|up rows rounded to the dtype, in fp32."""
    gate, up = h.to(dtype).float().chunk(2, dim=-1)
    if c.hidden_act == "silu":
        return torch.nn.functional.silu(gate).to(dtype).float() * up
    if c.hidden_act == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh").to(dtype).float() * up
    gate = gate.clamp(max=c.swiglu_limit)
    up = up.clamp(min=-c.swiglu_limit, max=c.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * c.swiglu_alpha))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "swiglu_clamped"])
@pytest.mark.parametrize("tiles", [None, GPU_PROMPT])
def test_gate_up_and_its_activation_in_one_pass(act, tiles):
    inter, k = 96, 512
    p = planes("Q4_0", 2 * inter, k)
    weight = BlockWeight([p])
    x = (torch.randn(20, k) * 2).bfloat16()
    h = reference(x, dequantize_planes(p))
    got = weight.gated(x, Activation(act))
    close(got, gated_reference(h, Activation(act), torch.bfloat16), torch.bfloat16)
    assert got.shape == (20, inter)


@pytest.mark.parametrize("kind", ["Q4_K", "MXFP4", "Q8_0"])
def test_a_mixtures_pairs_grouped_by_expert(kind):
    """Pairs sorted by expert (some experts with none, one with more than a tile), each
    times its expert's weight, plain and gated with gpt-oss's biases: as each expert's
    own product; and a pair's result the same in any grouping."""
    experts, n, k = 5, 64, 256
    stacked = planes(kind, experts * n, k, seed=11)
    weight = GroupedBlockWeight(experts, [stacked])
    counts = torch.tensor([3, 0, 20, 1, 0])
    x = torch.randn(int(counts.sum()), k).bfloat16()
    bias = (torch.randn(experts, n) * 0.1).bfloat16()
    values = dequantize_planes(stacked).view(experts, n, k)
    owner = torch.repeat_interleave(torch.arange(experts), counts)
    want = torch.stack([reference(x[i : i + 1], values[e])[0] for i, e in enumerate(owner)])
    close(weight(x, counts), want, torch.bfloat16)
    plain = weight(x, counts)
    with_bias = weight(x, counts, bias)
    close(with_bias, want + bias.float()[owner], torch.bfloat16)
    c = Activation("swiglu_clamped")
    h = want + bias.float()[owner]
    close(weight.gated(x, counts, c, bias), gated_reference(h, c, torch.bfloat16), torch.bfloat16)
    # The pairs of expert 2 alone: the same bits as among the others.
    alone = weight(x[3:23], torch.tensor([0, 0, 20, 0, 0]))
    assert torch.equal(alone, plain[3:23])


def test_embedding_rows_are_the_blocks_values():
    p = planes("Q6_K", 100, 512)
    ids = torch.tensor([5, 0, 99, 5])
    got = BlockWeight([p]).rows(ids, torch.bfloat16)
    assert torch.equal(got, dequantize_planes(p)[ids].bfloat16())


def test_block_weights_refuse_what_they_cannot_take():
    weight = BlockWeight([planes("Q8_0", 32, 64)])
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        weight(torch.randn(2, 32).bfloat16())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        weight(torch.randn(2, 64).double())
    with pytest.raises(ValueError, match="runs hold whole experts"):
        GroupedBlockWeight(3, [planes("Q8_0", 32, 64)])
