"""The GPU profiles hold a GGUF file's blocks (catalog/held_formats.py, formats/gpu_blocks.py):
on the CPU device in Triton's interpreter, the R9700 profile's engine holds each weight as
its file's blocks (the dense form never made), answers as the file's values do, and
batched equals alone within bf16's tolerance, a mixture's experts included; `lucedesk run`
says how the weights are held."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucedesk.catalog.fit import estimate
from lucedesk.catalog.summary import summarize_path
from lucedesk.engine.build import assemble, build_engine
from lucedesk.engine.models.causal_attention import CausalAttention
from lucedesk.engine.models.loader import load_model
from lucedesk.kernels.block_weights import BlockWeight, GroupedBlockWeight
from lucedesk.profile import all_profiles
from tests.engine_harness import Job, random_jobs, run_jobs_whole
from tests.gguf_writer import write_family_gguf, write_gguf
from tests.test_engine_correctness import BF16_LOGPROB_TOL, identical_up_to_near_ties
from tests.test_model_families import checkpoints  # noqa: F401 (the fixture)

# A file mixing every kind of block the GPU holds: K-quants, IQ4 with its table, 5-bit.
MIXED = {
    "token_embd": Q.Q4_K,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.IQ4_XS,
    "ffn_gate": Q.Q5_K,
    "ffn_up": Q.Q5_K,
    "ffn_down": Q.IQ4_NL,
    "output": Q.Q5_0,
}


def r9700_on_the_cpu(**changes):
    """The R9700 profile's settings, on the CPU device (its kernels in the interpreter)."""
    r9700 = all_profiles()["r9700"].engine
    small = dict(device="cpu", kv_pool_tokens=4096, max_model_len=1024, disk_cache_gb=0)
    return dataclasses.replace(r9700, **(small | changes))


def logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    model = loaded.model
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), CausalAttention(loaded.config))
        return model.compute_logits(hidden)


def values_held(held, dense):
    """`dense` (a load of the same file) with every weight the values `held` holds, in its
    dtype."""
    model = dense.model

    def put(param: torch.Tensor, values: torch.Tensor) -> None:
        param.data = values.to(model.dtype)

    for layer, ours in zip(model.layers, held.model.layers):
        for name, param in layer.projections().items():
            put(param, ours.quantized[name].dequantize())
        if layer.moe is not None:
            for proj in ("gate_up", "down"):
                weight = ours.moe.experts.quantized[proj]
                stacked = [weight.dequantize(e) for e in range(weight.num_experts)]
                put(getattr(layer.moe.experts, proj), torch.stack(stacked))
    put(model.lm_head, held.model.lm_head_quantized.dequantize())
    if held.model.embedding_held is not None and model.lm_head is not model.embed_tokens:
        put(model.embed_tokens, held.model.embedding_held.dequantize())
    return dense


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("mixed") / "mixed.gguf", MIXED, intermediate=512)


def test_the_r9700_holds_every_weight_as_its_files_blocks(mixed_file):
    """q|k (Q4_K) and v (Q6_K) as two runs of one weight, every other as its own type, the
    embedding too (its tied head would be the same weight); no dense matmul weight is made,
    and the weights take the bytes the fit counts."""
    built = build_engine(mixed_file, r9700_on_the_cpu())
    model = built.loaded.model
    try:
        assert built.weights == "q4" and built.kernels == "triton"
        layer = model.layers[1].quantized
        kinds = {name: [r.kind for r in w.runs] for name, w in layer.items()}
        assert kinds == {
            "qkv_proj": ["Q4_K", "Q6_K"], "o_proj": ["IQ4_XS"], "gate_up_proj": ["Q5_K"],
            "down_proj": ["IQ4_NL"],
        }  # fmt: skip
        assert [r.kind for r in model.lm_head_quantized.runs] == ["Q5_0"]
        assert [r.kind for r in model.embedding_held.runs] == ["Q4_K"]
        dense = [p for layer in model.layers for p in layer.projections().values()]
        assert all(p.numel() == 0 for p in [*dense, model.embed_tokens, model.lm_head])
        held = [w for layer in model.layers for w in layer.quantized.values()]
        held += [model.lm_head_quantized, model.embedding_held]
        need = estimate(summarize_path(mixed_file), r9700_on_the_cpu(), "cpu", "bfloat16")
        norms = sum(p.nbytes for p in model.parameters() if p.numel())
        assert need.weights == sum(w.nbytes for w in held) + norms
        assert "Q4_K" in built.held and "IQ4_XS" in built.held
    finally:
        built.engine.shutdown()


def test_blocks_answer_as_the_files_values(mixed_file):
    """Logits of the blocks held in bf16 on the Triton kernels against the file's values in
    fp32 on torch's: within bf16's rounding, the same greedy choices."""
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))
    want = logits(load_model(mixed_file, torch.float32), ids)
    held = load_model(mixed_file, torch.bfloat16, lazy_weights=True, lazy_embedding=True)
    assemble(held, r9700_on_the_cpu(), torch.device("cpu")).engine.shutdown()
    got = logits(held, ids)
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_held_blocks_batch_as_alone_under_preemption(mixed_file):
    """The R9700's settings with a pool shrunk to force preemption: each request's tokens
    batched equal its tokens alone up to bf16's near ties."""
    held = load_model(mixed_file, torch.bfloat16, lazy_weights=True, lazy_embedding=True)
    jobs = random_jobs(held, 4, seed=7, prompt_range=(8, 16), output_range=(12, 16), pressure=False)
    jobs = [Job(j.prompt, dataclasses.replace(j.params, logprobs=2), arrival_step=0) for j in jobs]
    small = r9700_on_the_cpu(kv_pool_tokens=3 * 16, decode_headroom_tokens=0)
    engine = assemble(held, small, torch.device("cpu")).engine
    assert isinstance(held.model.layers[0].quantized["qkv_proj"], BlockWeight)
    batched = run_jobs_whole(engine, jobs)
    assert engine.scheduler.num_preemptions > 0
    roomy = dataclasses.replace(small, kv_pool_tokens=4096, max_slots=1)
    alone = [
        run_jobs_whole(
            assemble(held, roomy, torch.device("cpu")).engine, [Job(j.prompt, j.params)],
            check=False,
        )[0]
        for j in jobs
    ]  # fmt: skip
    assert identical_up_to_near_ties(batched, alone, BF16_LOGPROB_TOL) >= 2


@pytest.mark.parametrize("arch,experts", [("qwen3moe", Q.Q4_K), ("gpt-oss", Q.MXFP4)])
def test_a_mixtures_experts_run_from_their_blocks(checkpoints, tmp_path, arch, experts):  # noqa: F811
    """Qwen3-MoE's Q4_K experts and gpt-oss's MXFP4 ones (with their biases and clamped
    SwiGLU) held as blocks and run grouped by expert, gate|up and its activation in one
    pass, in fp32: the logits of the values held on torch's ops, to fp32's rounding (in
    bf16 a tiny random gpt-oss sends a row of its second layer to another expert than in
    fp32 whichever kernels compute it: the kernels' bf16 is tested on its own); batched
    as alone."""
    folder = checkpoints.get((arch, experts), checkpoints[arch])
    path = write_family_gguf(folder, tmp_path / f"{arch}.gguf", arch, experts)
    ids = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(2))
    held = load_model(path, torch.float32, lazy_experts=True, lazy_weights=True)
    engine = assemble(held, r9700_on_the_cpu(dtype="float32"), torch.device("cpu")).engine
    blocks = held.model.moe_blocks()
    assert blocks and all(
        isinstance(moe.experts.quantized["gate_up"], GroupedBlockWeight)
        and moe.experts.quantized["gate_up"].runs[0].kind == experts.name
        and moe.experts.gate_up.numel() == 0
        for _, moe in blocks
    )
    # The file's other weights are F32, held as Q8_0: the values held are the reference's.
    want = logits(values_held(held, load_model(path, torch.float32)), ids)
    got = logits(held, ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    jobs = random_jobs(held, 3, seed=5, prompt_range=(4, 30), output_range=(6, 10), pressure=False)
    jobs = [Job(j.prompt, dataclasses.replace(j.params, logprobs=2), j.arrival_step) for j in jobs]
    batched = run_jobs_whole(engine, jobs)
    alone = [run_jobs_whole(engine, [Job(j.prompt, j.params)])[0] for j in jobs]
    engine.shutdown()
    assert identical_up_to_near_ties(batched, alone, 1e-3) >= 2


def test_lucedesk_run_says_how_the_weights_are_held(mixed_file):
    """`lucedesk run --profile r9700 --set device=cpu` in Triton's interpreter answers and
    says which form each kind of weight took; without the interpreter it says what to do."""
    command = [
        sys.executable, "-m", "lucedesk", "run", "--profile", "r9700", "--set", "device=cpu",
        "--set", "kv_pool_tokens=1024", "--model", str(mixed_file), "-p", "hello",
        "--max-tokens", "4",
    ]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    said = next(line for line in result.stderr.splitlines() if "weights held as" in line)
    assert "q4: " in said and "Q4_K" in said and "IQ4_XS" in said and "the embedding" in said
    env["TRITON_INTERPRET"] = "0"
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0 and "start with TRITON_INTERPRET=1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.default_model
def test_the_default_model_under_the_r9700_says_what_the_cpu_profile_says(default_model):
    """The default model's greedy text under the R9700 profile (its blocks on the Triton
    kernels, in the interpreter; bf16) equals the cpu profile's (the C++ kernels' levels
    with int8 activations) wherever the cpu profile's top two choices are clearly apart
    (0.5 in logprob): the two differ in rounding, not in meaning. Short: the interpreter
    takes ~25 s a token of this model."""
    from lucedesk.engine import SamplingParams
    from lucedesk.profile import resolve

    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    outputs = []
    for config in (r9700_on_the_cpu(max_slots=1), resolve("cpu", ["max_slots=1"])[1]):
        built = build_engine(default_model, dataclasses.replace(config, kv_pool_tokens=256))
        built.engine.start()
        try:
            prompt = built.engine.tokenizer.encode("The capital of France is")
            outputs.append(built.engine.submit(prompt, params).result(timeout=600))
        finally:
            built.engine.shutdown()
    gpu, cpu = outputs
    compared = 0
    for got, want, chances in zip(gpu.token_ids, cpu.token_ids, cpu.logprobs):
        top = sorted(dict(chances.top).values(), reverse=True)
        if len(top) > 1 and top[0] - top[1] < 0.5:
            break  # a near tie: past it the two texts may go their own ways
        assert got == want, f"{gpu.text!r} against the cpu profile's {cpu.text!r}"
        compared += 1
    assert compared >= 2, f"the cpu profile's choices were near ties: {cpu.logprobs}"
