"""4-, 6- and 8-bit weights (kernels/quantized.py LowBitWeight, csrc/lowbit.h) and the `q4`
format: the kernels against a torch reference of their arithmetic, the VNNI and plain paths
giving the same bits, rows independent of their batch, GGUF 4-, 5-, 6- and 8-bit blocks
taken exactly, and an engine on them giving each request its tokens alone."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from lucedesk.engine.build import apply_weight_format
from lucedesk.engine.models.gguf_blocks import block_levels
from lucedesk.engine.models.loader import load_model
from lucedesk.errors import ConfigError
from lucedesk.kernels.quantized import (
    MXFP4_LEVELS,
    Int8Weight,
    LowBitWeight,
    int8_tiles_available,
    lowbit_vector_available,
)
from lucedesk.kernels.scales import channel_blocks, six_bit_rows
from tests.engine_harness import make_engine, random_jobs, run_alone, run_jobs
from tests.gguf_writer import random_k_quant, write_gguf

# Every path this machine has: the plain loops always, AVX512-VNNI where the CPU has it.
PATHS = [False, True] if lowbit_vector_available() else [False]


def reference(weight: LowBitWeight, x: torch.Tensor) -> torch.Tensor:
    """The kernels' arithmetic in float64: activations quantized per row to int8 with one
    scale per 32 inputs (amax / 127, round half to even), exact group sums, d and m per
    group."""
    n, k = weight.shape
    xf = x.float().view(len(x), k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).double()
    xd = (amax / 127.0).double()
    levels = weight.levels().double().view(n, k // 32, 32)
    d = weight.d.transpose(1, 2).reshape(n, -1).double()
    m = weight.m.transpose(1, 2).reshape(n, -1).double()
    isum = torch.einsum("rgk,ngk->rng", xq, levels)
    xs = xq.sum(-1)  # [rows, groups]
    return (isum * d[None] * xd[..., 0][:, None] + m[None] * (xd[..., 0] * xs)[:, None]).sum(-1)


def random_levels(n: int, k: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.01
    m = -torch.rand(n, k // 32, generator=g) * 0.05
    return levels, d, m, g


def random_six_bit(n: int, k: int, seed: int):
    """6-bit levels with Q6_K's scales: d = factor (int8) * super (a float16 value) per
    sixteen inputs, m = -32 d; (levels, d, m, (factor, super), generator)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8)
    factor = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
    super_ = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    d = factor.float() * super_.repeat_interleave(16, 1)
    return levels, d, -32 * d, (factor, super_), g


def six_bit_reference(weight: LowBitWeight, x: torch.Tensor) -> torch.Tensor:
    """The 6-bit kernels' arithmetic in float64: activations quantized as for the others
    (127 / amax divided, not a reciprocal times 127), exact sums per sixteen inputs of
    (level - 32) * xq, each times its own d."""
    n, k = weight.shape
    xf = x.float().view(len(x), k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).double().view(len(x), k // 16, 16)
    xd = (amax / 127.0).double()[..., 0].repeat_interleave(2, 1)
    values = (weight.levels().double() - 32).view(n, k // 16, 16)
    isum = torch.einsum("rhk,nhk->rnh", xq, values)
    return (isum * six_bit_rows(weight.d, k).double()[None] * xd[:, None]).sum(-1)


@pytest.mark.parametrize("n,k", [(960, 512), (16, 256), (64, 1536)])
def test_six_bit_weights_compute_their_stated_arithmetic(n, k):
    """Q6_K's form as it is, 0.83 bytes a weight: each output within bfloat16 rounding of
    the exact arithmetic (and float32 sums' rounding), the plain loops and the VNNI path the
    same bits, every row what it is alone, a row of zeros zero, and the values
    d * (level - 32)."""
    levels, d, m, factors, g = random_six_bit(n, k, n + k)
    x = torch.randn(37, k, generator=g).bfloat16()
    x[3] = 0
    outs = []
    for vector in PATHS:
        weight = LowBitWeight(levels, d, m, 6, vector=vector, factors=factors)
        assert torch.equal(weight.levels(), levels)
        assert torch.equal(weight.dequantize(), (levels.float() - 32) * d.repeat_interleave(16, 1))
        got = weight(x)
        want = six_bit_reference(weight, x)
        # bf16 rounding of each, and float32 sums' rounding (outputs that cancel)
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 2**-20 * want.abs().max()).all()
        assert torch.equal(got[3], torch.zeros(n, dtype=torch.bfloat16))
        for start, end in [(0, 1), (5, 21), (30, 37), (36, 37)]:
            assert torch.equal(weight(x[start:end]), got[start:end])
        outs.append(got)
    assert all(torch.equal(o, outs[0]) for o in outs), "the VNNI and plain paths differ"
    assert weight.nbytes <= n * k * 0.83


def test_six_bit_weights_need_their_factors():
    levels, d, m, (factor, super_), _ = random_six_bit(32, 256, 1)
    with pytest.raises(ValueError, match="need their factors"):
        LowBitWeight(levels, d, m, 6)
    with pytest.raises(ValueError, match="factors differ"):
        LowBitWeight(levels, d * 1.5, m, 6, factors=(factor, super_))
    with pytest.raises(ValueError, match="exceed 63"):
        LowBitWeight(levels + 64, d, m, 6, factors=(factor, super_))
    with pytest.raises(ValueError, match="K % 256"):
        LowBitWeight(levels[:, :128], d[:, :8], m[:, :8], 6, factors=(factor[:, :8], super_))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (16, 32)])
def test_low_bit_weights_compute_their_stated_arithmetic(bits, n, k):
    levels, d, m, g = random_levels(n, k, bits, n + k + bits)
    x = torch.randn(37, k, generator=g).bfloat16()
    x[3] = 0  # a row of zeros: scale 0, no division by it
    outs = []
    for vector in PATHS:
        weight = LowBitWeight(levels, d, m, bits, vector=vector)
        assert torch.equal(weight.levels(), levels)
        got = weight(x)
        want = reference(weight, x)
        # bf16 output: within its rounding of the exact result.
        assert (got.double() - want).abs().max() <= 2**-7 * want.abs().max()
        assert torch.equal(got[3], torch.zeros(n, dtype=torch.bfloat16))
        outs.append(got)
        # ...and within the activation quantization of the float product.
        exact = x.float() @ weight.dequantize().t()
        assert (got.float() - exact).abs().max() <= 0.02 * exact.abs().max()
    assert all(torch.equal(o, outs[0]) for o in outs), "the VNNI and plain paths differ"
    assert weight.nbytes < n * k * (0.76 if bits == 4 else 1.26)


def test_activations_are_quantized_to_nearest_ties_to_even():
    """An identity weight (level 1 on the diagonal, d = 1, m = 0) reads each activation back
    as the kernels quantized it, exactly: amax / 127 * round(x * 127 / amax), halves to
    even; rows of ties (amax 127: the products are the inputs), zeros and wide ranges; a NaN
    takes no part in its group's amax."""
    k = 96
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3)) * 3
    x[1, :32] = torch.tensor([127.0] + [i + 0.5 for i in range(-15, 16)])
    x[1, 32:64] = -x[1, :32]
    x[2, 64:] = 0
    x[4] *= torch.logspace(-20, 20, k)
    x[5, 40] = float("nan")
    x = x.bfloat16()
    groups = x.float().view(6, -1, 32)
    amax = groups.abs().nan_to_num(0).amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    want = (torch.round(groups * inv) * (amax / 127)).view(6, k).bfloat16()
    ones = torch.eye(k, dtype=torch.uint8)
    for vector in PATHS:
        weight = LowBitWeight(ones, torch.ones(k, k // 32), torch.zeros(k, k // 32), 8, vector)
        got = weight(x)
        got[5, 40] = want[5, 40] = 0  # the NaN's own output is the kernels' business
        assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [4, 8])
def test_low_bit_rows_do_not_depend_on_the_batch(bits):
    levels, d, m, g = random_levels(960, 576, bits, 5)
    x = torch.randn(45, 576, generator=g).bfloat16()
    for vector in PATHS:
        weight = LowBitWeight(levels, d, m, bits, vector=vector)
        together = weight(x)
        for start, end in [(0, 1), (3, 4), (5, 21), (17, 18), (30, 45), (44, 45), (1, 3)]:
            assert torch.equal(weight(x[start:end]), together[start:end])


@pytest.mark.parametrize("bits", [4, 8])
def test_float16_scales_give_the_bits_of_float32_scales(bits):
    """Scales that are float16 values (a Q4_0 / Q4_1 file's) are held in float16, a quarter
    fewer bytes a 4-bit weight, and give the same bits as the same scales in float32."""
    levels, d, m, g = random_levels(576, 1536, bits, 11)
    d, m = d.half().float(), m.half().float()
    x = torch.randn(19, 1536, generator=g).bfloat16()
    for vector in PATHS:
        weight = LowBitWeight(levels, d, m, bits, vector=vector)
        assert weight.d.dtype == weight.m.dtype == torch.float16
        wide = LowBitWeight(levels, d, m, bits, vector=vector)
        wide.d, wide.m = wide.d.float(), wide.m.float()
        assert torch.equal(weight(x), wide(x))
        assert torch.equal(weight.dequantize(), wide.dequantize())
    assert weight.nbytes <= 576 * 1536 * (0.625 if bits == 4 else 1.125)
    assert LowBitWeight(levels, d + 1e-9, m, bits).d.dtype == torch.float32


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_scales_give_the_bits_of_held_offsets(bits):
    """Levels symmetric about 2^(bits - 1) (Q4_0's, Q8_0's: m = -2^(bits - 1) d) hold their
    float16 d alone, 0.5625 / 1.0625 bytes a weight, and give the bits of the same scales
    with m held beside them, on both paths."""
    levels, d, _, g = random_levels(96, 1024, bits, 17)
    d = d.half().float()
    m = -float(1 << (bits - 1)) * d
    x = torch.randn(13, 1024, generator=g).bfloat16()
    for vector in PATHS:
        weight = LowBitWeight(levels, d, m, bits, vector=vector)
        assert weight.d.dtype == torch.float16 and weight.m.numel() == 0
        assert weight.nbytes == 96 * 1024 * (0.5625 if bits == 4 else 1.0625)
        held = LowBitWeight(levels, d, m, bits, vector=vector)
        held.m = channel_blocks(m).half()
        assert torch.equal(weight(x), held(x))
        assert torch.equal(weight.dequantize(), held.dequantize())
        assert torch.equal(
            weight.dequantize(),
            levels.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1),
        )
    assert LowBitWeight(levels, d, m + d / 2, bits).m.numel() == d.numel()  # not symmetric


def test_exponent_scales_give_the_bits_of_float32_scales():
    """Scales that are powers of two with m = -12 d (MXFP4's) are held as exponent bytes,
    0.53 bytes a 4-bit weight, the smallest included (2^-128 and 2^-127, float32 subnormals),
    and give the same bits as the same scales in float32, on both paths."""
    levels, _, _, g = random_levels(96, 512, 4, 13)
    e = torch.randint(100, 140, (96, 512 // 32), generator=g)
    e[0, :4] = torch.tensor([0, 1, 2, 200])
    d = torch.ldexp(torch.ones(96, 512 // 32), e - 128)
    x = torch.randn(11, 512, generator=g).bfloat16()
    for vector in PATHS:
        weight = LowBitWeight(levels, d, -12 * d, 4, vector=vector, table=MXFP4_LEVELS)
        assert weight.d.dtype == torch.float8_e8m0fnu and weight.m.numel() == 0
        assert weight.nbytes <= 96 * 512 * 0.532
        wide = LowBitWeight(levels, d, -12 * d, 4, vector=vector, table=MXFP4_LEVELS)
        wide.d, wide.m = (channel_blocks(s) for s in (d, -12 * d))
        assert torch.equal(weight(x), wide(x))
        assert torch.equal(weight.dequantize(), wide.dequantize())
    assert LowBitWeight(levels, d, -11 * d, 4).d.dtype == torch.float32  # m is not -12 d


def test_eight_bit_weights_from_float_lose_at_most_a_510th_of_a_group():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g) * 0.05
    weight = LowBitWeight.from_float(w)
    assert weight.bits == 8
    groups = w.view(64, -1, 32)
    ranges = groups.amax(-1) - groups.amin(-1)
    err = (weight.dequantize() - w).view(64, -1, 32).abs().amax(-1)
    assert (err <= ranges / 510 + 1e-7).all()


def test_low_bit_weights_refuse_what_they_cannot_hold():
    levels, d, m, _ = random_levels(32, 64, 4, 1)
    with pytest.raises(ValueError, match="bfloat16"):
        LowBitWeight(levels, d, m, 4)(torch.randn(2, 64))
    with pytest.raises(ValueError, match="exceed 15"):
        LowBitWeight(levels + 16, d, m, 4)
    with pytest.raises(ValueError, match="N % 16"):
        LowBitWeight(levels[:24], d[:24], m[:24], 4)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        LowBitWeight(levels, d, m, 2)


@pytest.mark.parametrize(
    "qtype,top",
    [
        (Q.Q4_0, 15), (Q.Q4_1, 15), (Q.Q4_K, 15), (Q.Q5_0, 31), (Q.Q5_1, 31), (Q.Q8_0, 255),
        (Q.Q6_K, 63),
    ],
)  # fmt: skip
def test_blocks_give_gguf_dequantized_values(qtype, top):
    """The levels, d and m read from a block are the values gguf's own dequantizer gives,
    to the bit: d * level + m in float32 is the same product and sum (for Q5_0 and Q8_0,
    whose values are d * (q - offset), exact either way; Q6_K's d is per sixteen values and
    its value d * (level - 32)). Q6_K's factors give its d exactly; a Q6_K weight held from
    them has the file's values."""
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.Q4_K, Q.Q6_K):
        raw = random_k_quant(16, 512, qtype, rng)
    else:
        raw = quants.quantize((rng.standard_normal((16, 512)) * 0.1).astype(np.float32), qtype)
    want = quants.dequantize(raw, qtype).reshape(-1)
    held = block_levels(raw.reshape(-1), qtype.name)
    assert held.bits == {15: 4, 63: 6}.get(top, 8)
    assert top // 2 < held.levels.max() <= top  # (Q5's fifth bit, Q6's high pairs are read)
    if qtype == Q.Q6_K:
        got = (held.levels.reshape(-1, 16).astype(np.float32) - 32) * held.d[:, None]
        factor, super_ = held.factors
        np.testing.assert_array_equal(factor * np.repeat(super_, 16), held.d)
        weight = LowBitWeight(
            torch.from_numpy(held.levels).view(16, 512),
            *(torch.from_numpy(a).view(16, -1) for a in (held.d, held.m)),
            bits=6,
            factors=tuple(torch.from_numpy(a).view(16, -1) for a in held.factors),
        )
        np.testing.assert_array_equal(weight.dequantize().numpy().reshape(-1), want)
    else:
        got = held.levels.reshape(-1, 32).astype(np.float32) * held.d[:, None] + held.m[:, None]
    np.testing.assert_array_equal(got.reshape(-1), want)


# Projections in every 4-bit type (q and k also through llama.cpp's row permutation), the
# LM head and down in Q6_K as llama.cpp's Q4_K_M has them: held at 6 bits as the file has
# them, with a notice naming them.
FOUR_BIT = {
    "token_embd": Q.Q8_0,
    "output": Q.Q6_K,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q4_1,
    "attn_output": Q.Q4_1,
    "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q6_K,
}


@pytest.fixture(scope="module")
def four_bit_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("q4") / "q4.gguf", FOUR_BIT)


def test_q4_takes_the_files_blocks_exactly(four_bit_gguf, caplog):
    loaded = load_model(four_bit_gguf, torch.bfloat16)
    model = loaded.model
    projections = ("qkv_proj", "gate_up_proj", "down_proj")
    before = {p: model.layers[1].projections()[p].clone() for p in projections}
    head = model.lm_head.clone()
    ids = torch.randint(0, loaded.config.vocab_size, (24,), generator=torch.Generator())
    plain = logits(loaded, ids)
    with caplog.at_level(logging.INFO, logger="lucedesk.engine.build"):
        assert apply_weight_format(model, "q4", "cpu") == "q4"
    assert "at 6 bits as the file's levels (Q6_K)" in caplog.text  # down, the LM head
    for proj, weight in before.items():
        held = model.layers[1].quantized[proj]
        assert held.bits == (6 if proj == "down_proj" else 4)
        # The bf16 model holds the same values: the same rows, fused in the same order.
        assert torch.equal(held.dequantize().bfloat16(), weight)
    assert model.lm_head_quantized.bits == 6
    assert torch.equal(model.lm_head_quantized.dequantize().bfloat16(), head)
    got = logits(loaded, ids)
    assert (got - plain).abs().max() <= 0.05 * plain.abs().max()
    assert (got.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9


# A file as llama.cpp's Q4_K_M mixes types (Gemma 3 270M's is so): 5-bit q, k and gate,
# 8-bit v and LM head, 4-bit o and up (up fused with gate at 8 bits), a 6-bit down.
MIXED = {
    "output": Q.Q8_0,
    "attn_q": Q.Q5_0,
    "attn_k": Q.Q5_1,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q6_K,
}


@pytest.mark.parametrize("wanted", ["q4", "int8"])
def test_five_and_eight_bit_blocks_are_held_as_the_files_levels(tmp_path, caplog, wanted):
    """Each weight whose parts are grids of levels holds the file's values exactly: with q4
    at 4 bits where every part is 4-bit, else at 8 bits with the file's float16 scales;
    with int8 all at 8 bits. The Q6_K down projection is held at 6 bits with q4, and with
    int8 taken from its values.
    `auto` takes q4 for a file whose MLP is 5-bit where the VNNI kernels run."""
    path = write_gguf(tmp_path / "mixed.gguf", MIXED)
    loaded = load_model(path, torch.bfloat16)
    model = loaded.model
    before = {p: w.clone() for p, w in model.layers[1].projections().items()}
    head = model.lm_head.clone()
    ids = torch.randint(0, loaded.config.vocab_size, (24,), generator=torch.Generator())
    plain = logits(loaded, ids)
    with caplog.at_level(logging.INFO, logger="lucedesk.engine.build"):
        assert apply_weight_format(model, wanted, "cpu") == wanted
    held = model.layers[1].quantized
    if wanted == "int8" and not lowbit_vector_available():  # on AMX tiles or in rows
        assert all(isinstance(w, Int8Weight) for w in [*held.values(), model.lm_head_quantized])
        assert "as the file's levels" not in caplog.text
    else:
        grids = {"qkv_proj": 8, "o_proj": 4 if wanted == "q4" else 8, "gate_up_proj": 8}
        for proj, bits in grids.items():
            assert held[proj].bits == bits
            assert torch.equal(held[proj].dequantize().bfloat16(), before[proj])
        assert held["qkv_proj"].d.dtype == held["gate_up_proj"].d.dtype == torch.float16
        if wanted == "q4":
            assert held["down_proj"].bits == 6
            assert torch.equal(held["down_proj"].dequantize().bfloat16(), before["down_proj"])
            assert "at 6 bits as the file's levels (Q6_K)" in caplog.text
        else:
            assert held["down_proj"].bits == 8 and held["down_proj"].d.dtype == torch.float32
            assert "from their values (Q6_K)" in caplog.text
        lm_head = model.lm_head_quantized
        assert lm_head.bits == 8 and lm_head.d.dtype == torch.float16
        assert torch.equal(lm_head.dequantize().bfloat16(), head)
        assert "as the file's levels (Q5_0+Q5_1+Q8_0)" in caplog.text
        assert "as the file's levels (Q5_0+Q4_0)" in caplog.text
    got = logits(loaded, ids)
    assert (got - plain).abs().max() <= 0.05 * plain.abs().max()
    expected = "q4" if lowbit_vector_available() else "int8" if int8_tiles_available() else "dtype"
    assert apply_weight_format(load_model(path, torch.bfloat16).model, "auto", "cpu") == expected


def logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    from lucedesk.engine.models.causal_attention import CausalAttention

    model = loaded.model
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), CausalAttention(loaded.config))
        return model.compute_logits(hidden)


def test_q4_engine_gives_each_request_its_tokens_alone(four_bit_gguf):
    """bf16 with 4-bit weights: requests arriving at different steps, batched, get the
    tokens each gets alone (every prompt goes in one chunk either way, so only the batch
    differs)."""
    loaded = load_model(four_bit_gguf, torch.bfloat16)
    jobs = random_jobs(loaded, 8, 4, prompt_range=(1, 60), output_range=(8, 40), pressure=False)
    engine = make_engine(loaded, kernels="cpu", weights="q4", max_slots=4, kv_pool_tokens=4096)
    assert loaded.model.weight_format == "q4"
    batched = run_jobs(engine, jobs)
    assert batched == run_alone(loaded, jobs, "cpu", "q4")
    assert [len(b) for b in batched] == [j.params.max_tokens for j in jobs]


def test_q4_needs_a_four_bit_file(tiny_llama, four_bit_gguf, tmp_path):
    """`auto` takes q4 for a 4-bit file where the VNNI kernels run; asking for q4 without
    4-bit blocks, or on a model it cannot run, says why."""
    from lucedesk.config import EngineConfig

    expected = "q4" if lowbit_vector_available() else "dtype"
    assert apply_weight_format(load_model(four_bit_gguf, torch.bfloat16).model, "auto", "cpu") == (
        expected
    )

    with pytest.raises(ConfigError, match="weights must be one of auto, dtype, int8, q4"):
        EngineConfig(weights="int4").validate()
    folder = load_model(tiny_llama, torch.bfloat16)
    with pytest.raises(ConfigError, match="not from a GGUF file"):
        apply_weight_format(folder.model, "q4", "cpu")
    eight = write_gguf(tmp_path / "q8.gguf", {"attn_q": Q.Q8_0, "ffn_gate": Q.Q8_0})
    loaded = load_model(eight, torch.bfloat16)
    with pytest.raises(ConfigError, match="this model's are Q8_0"):
        apply_weight_format(loaded.model, "q4", "cpu")
    assert apply_weight_format(loaded.model, "auto", "cpu") != "q4"
    fp32 = load_model(eight, torch.float32)
    with pytest.raises(ConfigError, match="on the cpu kernels need a bfloat16 model"):
        apply_weight_format(fp32.model, "q4", "cpu")


# IQ4 as 27B models are shared for 32 GB cards: IQ4_XS for most weights, IQ4_NL beside it.
IQ4 = {
    "token_embd": Q.Q8_0,
    "output": Q.Q6_K,
    "attn_q": Q.IQ4_XS,
    "attn_k": Q.IQ4_XS,
    "attn_v": Q.IQ4_NL,
    "attn_output": Q.IQ4_XS,
    "ffn_gate": Q.IQ4_XS,
    "ffn_up": Q.IQ4_XS,
    "ffn_down": Q.IQ4_NL,
}


def test_iq4_files_load_on_the_cpu_and_keep_their_values(tmp_path):
    """An IQ4_XS file (IQ4_NL beside it) loads and is held as its 4-bit codes looked up in
    IQ4's 16-entry table, each weight's values exactly the file's; `auto` takes it as q4
    where the VNNI kernels run, and an engine on it answers."""
    path = write_gguf(tmp_path / "iq4.gguf", IQ4)
    loaded = load_model(path, torch.bfloat16)
    model = loaded.model
    before = {p: w.clone() for p, w in model.layers[1].projections().items()}
    ids = torch.randint(0, loaded.config.vocab_size, (24,), generator=torch.Generator())
    plain = logits(loaded, ids)
    assert apply_weight_format(model, "q4", "cpu") == "q4"
    for proj, weight in before.items():
        held = model.layers[1].quantized[proj]
        assert held.bits == 4 and held.lut is not None  # q|k|v: IQ4_XS and IQ4_NL, one table
        assert torch.equal(held.dequantize().bfloat16(), weight)
    got = logits(loaded, ids)
    assert (got - plain).abs().max() <= 0.05 * plain.abs().max()
    expected = "q4" if lowbit_vector_available() else "int8" if int8_tiles_available() else "dtype"
    fresh = load_model(path, torch.bfloat16)
    assert apply_weight_format(fresh.model, "auto", "cpu") == expected
    engine = make_engine(fresh, kernels="cpu", weights="auto", max_slots=2, kv_pool_tokens=1024)
    jobs = random_jobs(fresh, 2, 1, prompt_range=(4, 20), output_range=(4, 8), pressure=False)
    assert [len(t) for t in run_jobs(engine, jobs)] == [j.params.max_tokens for j in jobs]
