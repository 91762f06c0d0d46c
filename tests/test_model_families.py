"""The families beyond the Llama kin as llama.cpp's files hold them: tiny random Qwen3-MoE,
gpt-oss and Gemma 3 checkpoints written as GGUF (experts in Q4_K, Q8_0 or MXFP4, in 3-D
tensors, gpt-oss's gate/up split, Gemma's 1 + w norms) give transformers' logits on the
same values; batched equals alone with preemption, in fp32 and on the low-bit experts."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucedesk.engine.models.loader import load_model
from tests.conftest import NEW_ARCHS, write_tiny_model
from tests.engine_harness import make_engine, random_jobs, run_alone, run_jobs
from tests.gguf_writer import gguf_expert_tensors, write_family_gguf
from tests.test_engine_correctness import KERNELS, TIGHT, check_batched_equals_alone
from tests.test_model_parity import assert_logits_match, reference_model

GGUF_CASES = [("qwen3moe", Q.Q4_K), ("qwen3moe", Q.Q8_0), ("gpt-oss", Q.MXFP4), ("gemma3", Q.F32)]


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    """The tiny checkpoints, and a Qwen3-MoE one wide enough for Q4_K's 256-value blocks."""
    wide = write_tiny_model(tmp_path_factory.mktemp("wide") / "qwen3moe", "qwen3moe", wide=True)
    return {**tiny_models, ("qwen3moe", Q.Q4_K): wide}


def set_reference_experts(ref, arch: str, path) -> None:
    """The transformers model's expert weights replaced by the file's, as gguf's own code
    dequantizes them (the file's experts are quantized, the checkpoint's are not)."""
    tensors = {k: torch.from_numpy(v) for k, v in gguf_expert_tensors(path).items()}
    for i, layer in enumerate(ref.model.layers):
        gate = tensors.get(f"blk.{i}.ffn_gate_exps.weight")
        if gate is None:
            continue
        up, down = tensors[f"blk.{i}.ffn_up_exps.weight"], tensors[f"blk.{i}.ffn_down_exps.weight"]
        experts = layer.mlp.experts
        if arch == "gpt-oss":  # x @ W with gate and up interleaved
            gate_up = torch.empty(gate.shape[0], 2 * gate.shape[1], gate.shape[2])
            gate_up[:, 0::2], gate_up[:, 1::2] = gate, up
            experts.gate_up_proj.data = gate_up.transpose(1, 2).contiguous()
            experts.down_proj.data = down.transpose(1, 2).contiguous()
        else:
            experts.gate_up_proj.data = torch.cat([gate, up], 1)
            experts.down_proj.data = down


@pytest.mark.parametrize("arch,experts", GGUF_CASES)
def test_gguf_logits_match_transformers(checkpoints, tmp_path, arch, experts):
    folder = checkpoints.get((arch, experts), checkpoints[arch])
    path = write_family_gguf(folder, tmp_path / f"{arch}.gguf", arch, experts)
    ours = load_model(path, torch.float32)
    assert ours.config.architecture == arch
    ref = reference_model(folder)
    set_reference_experts(ref, arch, path)
    if arch == "gemma3":  # a file has no query_pre_attn_scalar: llama.cpp takes head_dim
        for layer in ref.model.layers:
            layer.self_attn.scaling = ours.config.head_dim**-0.5
    assert_logits_match(ours, ref, seed=2)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_greedy_batched_equals_alone(tiny_models, arch, kernels):
    """Three slots, small chunks, a pool that forces preemption, prompts past the window."""
    loaded = load_model(tiny_models[arch], torch.float32)
    check_batched_equals_alone(loaded, random_jobs(loaded, 12, 0), kernels, **TIGHT)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_seeded_sampling_batched_equals_alone(tiny_models, arch):
    loaded = load_model(tiny_models[arch], torch.float32)
    check_batched_equals_alone(loaded, random_jobs(loaded, 12, 1, sampled=True), "cpu", **TIGHT)


@pytest.mark.parametrize("arch,experts", [("qwen3moe", Q.Q4_K), ("gpt-oss", Q.MXFP4)])
def test_low_bit_experts_come_from_the_file_and_batch_as_alone(
    checkpoints, tmp_path, arch, experts
):
    """bf16 with q4 weights: the experts are taken from the file's own blocks (never held
    densely), run in the grouped C++ pass, and batched requests get their tokens alone."""
    folder = checkpoints.get((arch, experts), checkpoints[arch])
    path = write_family_gguf(folder, tmp_path / f"{arch}.gguf", arch, experts)
    loaded = load_model(path, torch.bfloat16, lazy_experts=True)
    blocks = loaded.model.moe_blocks()
    assert blocks and all(moe.experts.gate_up.numel() == 0 for _, moe in blocks)
    jobs = random_jobs(loaded, 8, 4, prompt_range=(1, 60), output_range=(8, 32), pressure=False)
    engine = make_engine(loaded, kernels="cpu", weights="q4", max_slots=4, kv_pool_tokens=4096)
    for _, moe in blocks:
        held = moe.experts.quantized["gate_up"]
        assert held.bits == 4 and (held.lut is not None) == (experts == Q.MXFP4)
        assert moe.experts.gate_up.numel() == moe.experts.down.numel() == 0
    batched = run_jobs(engine, jobs)
    assert batched == run_alone(loaded, jobs, "cpu", "q4")
    assert [len(b) for b in batched] == [j.params.max_tokens for j in jobs]


def test_a_mixture_takes_a_step_without_rows(tiny_models):
    loaded = load_model(tiny_models["qwen3moe"], torch.float32)
    moe = loaded.model.layers[0].moe
    out = moe(torch.empty(0, loaded.config.hidden_size), loaded.model.kernels)
    assert out.shape == (0, loaded.config.hidden_size)


def test_gemma_norms_in_bf16_round_as_the_reference(tiny_models):
    """(1 + w) held in float32 and multiplied before the one rounding to bf16, as
    transformers' Gemma3RMSNorm does (in bf16 the weight itself would lose w's bits)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from lucedesk.kernels.layers_torch import rms_norm

    loaded = load_model(tiny_models["gemma3"], torch.bfloat16)
    assert loaded.model.layers[0].attn_norm.dtype == torch.float32
    assert loaded.model.layers[0].q_norm.dtype == torch.float32
    hidden, eps = loaded.config.hidden_size, loaded.config.rms_norm_eps
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(hidden, generator=g) * 0.1).bfloat16()  # a bf16 checkpoint's weight
    reference = Gemma3RMSNorm(hidden, eps=eps).bfloat16()
    reference.weight.data = w
    x = (torch.randn(17, hidden, generator=g) * 4).bfloat16()
    assert torch.equal(rms_norm(x, w.float() + 1, eps), reference(x))
    assert not torch.equal(rms_norm(x, (w.float() + 1).bfloat16(), eps), reference(x))
