"""Batching changes no output: every request's tokens equal those of running it alone (fp32,
CPU), with requests arriving at different steps, three slots, a small budget, small chunks and
a KV pool small enough to force preemption and recomputation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lucedesk.engine.kv_cache import blocks_for
from lucedesk.engine.models.loader import load_model
from tests.engine_harness import make_engine, random_jobs, run_alone, run_jobs

# The C++ kernels need a C++ compiler (g++ or clang++), as the README says: without one
# these tests fail rather than skip, so a run never passes without testing them.
KERNELS = ["torch", "cpu"]

TIGHT = dict(
    max_slots=3,
    block_size=16,
    max_num_batched_tokens=24,
    prefill_chunk_idle=16,
    prefill_chunk_decoding=8,
    decode_headroom_tokens=0,
)


def check_batched_equals_alone(loaded, jobs, kernels="torch", weights="dtype", **config):
    """Returns the batched engine (for its counters)."""
    # The pool holds the largest request and little more, so the others must make room.
    largest = max(len(j.prompt) + j.params.max_tokens for j in jobs)
    config["kv_pool_tokens"] = blocks_for(largest, config["block_size"]) * config["block_size"]
    engine = make_engine(loaded, kernels=kernels, weights=weights, **config)
    assert engine.seq_engine.kernels.name == kernels
    batched = run_jobs(engine, jobs)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    lookup = {k: v for k, v in config.items() if k.startswith("prompt_lookup")}
    alone = run_alone(loaded, jobs, kernels, weights, **lookup)
    for i, (got, want) in enumerate(zip(batched, alone)):
        assert got == want, f"request {i} (prompt {len(jobs[i].prompt)} tokens) differs"
        assert len(got) == jobs[i].params.max_tokens
    assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks
    return engine


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_batched_equals_alone_tiny(tiny_models, arch, seed, kernels):
    loaded = load_model(tiny_models[arch], torch.float32)
    check_batched_equals_alone(loaded, random_jobs(loaded, 14, seed), kernels, **TIGHT)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_seeded_sampling_batched_equals_alone_tiny(tiny_models, arch, kernels):
    loaded = load_model(tiny_models[arch], torch.float32)
    jobs = random_jobs(loaded, 14, 0, sampled=True)
    check_batched_equals_alone(loaded, jobs, kernels, **TIGHT)


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("prompt_lookup", [True, False])
def test_seeded_sampling_batched_equals_alone_with_cache_and_drafts(
    tiny_models, prefix_cache, prompt_lookup
):
    """Seeded draws with the prefix cache and prompt-lookup drafts each on and off, under
    preemption (one grammar-free path each: the draws are keyed by position, not by step)."""
    loaded = load_model(tiny_models["qwen2"], torch.float32)
    # Prompts that repeat a six-token phrase and a cool temperature: drafts are offered and
    # some are kept.
    jobs = [
        replace(
            job,
            prompt=(job.prompt[:6] * 100)[: len(job.prompt)],
            params=replace(job.params, temperature=0.3),
        )
        for job in random_jobs(loaded, 14, 2, sampled=True)
    ]
    config = dict(TIGHT, prefix_cache=prefix_cache, prompt_lookup=prompt_lookup)
    engine = check_batched_equals_alone(loaded, jobs, "cpu", **config)
    scheduler = engine.scheduler
    if prompt_lookup:
        assert scheduler.num_draft_rows > 0 and scheduler.num_accepted_tokens > 0
    assert (scheduler.num_prefix_hit_tokens > 0) == prefix_cache


@pytest.mark.default_model
@pytest.mark.parametrize("kernels", KERNELS)
def test_greedy_batched_equals_alone_default_model(default_model, kernels):
    loaded = load_model(default_model, torch.float32)
    jobs = random_jobs(loaded, 12, 3)
    check_batched_equals_alone(loaded, jobs, kernels, **TIGHT)


@pytest.mark.default_model
@pytest.mark.parametrize("kernels", KERNELS)
def test_seeded_sampling_batched_equals_alone_default_model(default_model, kernels):
    loaded = load_model(default_model, torch.float32)
    jobs = random_jobs(loaded, 14, 0, sampled=True)
    check_batched_equals_alone(loaded, jobs, kernels, **TIGHT)


@pytest.mark.default_model
def test_cpu_kernels_give_the_torch_tokens_default_model(default_model):
    """The C++ kernels compute what the torch ops compute: a profile choosing them changes
    no greedy output of the real model (fp32; bf16 differs in summation order only)."""
    loaded = load_model(default_model, torch.float32)
    jobs = random_jobs(loaded, 6, 5, output_range=(16, 48), pressure=False)
    engine = make_engine(loaded, kernels="cpu", **{**TIGHT, "kv_pool_tokens": 4096})
    assert run_jobs(engine, jobs) == run_alone(loaded, jobs, "torch")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_attention_batched_equals_alone(tiny_models, arch):
    """With the Triton kernels selected (Triton's interpreter on a CPU), batched requests give
    the tokens each gets alone on the torch reference path. Kept small: the interpreter runs
    each kernel program in Python."""
    loaded = load_model(tiny_models[arch], torch.float32)
    jobs = random_jobs(loaded, 5, 2, prompt_range=(1, 60), output_range=(1, 16), pressure=False)
    engine = make_engine(loaded, kernels="triton", **{**TIGHT, "kv_pool_tokens": 4096})
    assert engine.seq_engine.kernels.name == "triton"
    batched = run_jobs(engine, jobs)
    assert batched == run_alone(loaded, jobs, "torch")
    assert [len(b) for b in batched] == [j.params.max_tokens for j in jobs]


# Batched against alone in bf16: greedy tokens may part where two candidates are within
# bf16's rounding of each other (prompt K/V computed in other chunks, recomputed after a
# preemption). Up to the first parting every token's logprob agrees within this, and where
# they part, the alone run's top two candidates are within it too.
BF16_LOGPROB_TOL = 0.15


def test_r9700_profile_bf16_triton_batched_matches_alone(tiny_llama):
    """The settings the R9700 runs (Triton kernels, bf16, its block size, budget and chunk
    sizes), on the CPU in Triton's interpreter with a tiny model and a pool shrunk to force
    preemption: batched equals alone within bf16's tolerance."""
    import dataclasses

    from lucedesk.engine.build import assemble
    from lucedesk.profile import all_profiles
    from tests.engine_harness import Job, run_jobs_whole

    r9700 = all_profiles()["r9700"].engine
    loaded = load_model(tiny_llama, torch.bfloat16)
    jobs = random_jobs(
        loaded, 4, seed=7, prompt_range=(20, 40), output_range=(24, 32), pressure=False
    )
    jobs = [Job(j.prompt, dataclasses.replace(j.params, logprobs=2), arrival_step=0) for j in jobs]
    small = dataclasses.replace(r9700, device="cpu", kv_pool_tokens=6 * 16, max_model_len=1024)
    engine = assemble(loaded, small, torch.device("cpu")).engine
    assert engine.seq_engine.kernels.name == "triton" and loaded.model.dtype == torch.bfloat16
    batched = run_jobs_whole(engine, jobs)
    assert engine.scheduler.num_preemptions > 0
    roomy = dataclasses.replace(small, kv_pool_tokens=4096, max_slots=1)
    same = 0
    for job, got in zip(jobs, batched):
        alone = run_jobs_whole(
            assemble(loaded, roomy, torch.device("cpu")).engine,
            [Job(job.prompt, job.params)],
            check=False,
        )[0]
        assert len(got.token_ids) == len(alone.token_ids) == job.params.max_tokens
        common = next(
            (i for i, (a, b) in enumerate(zip(got.token_ids, alone.token_ids)) if a != b),
            len(got.token_ids),
        )
        same += common == len(got.token_ids)
        for a, b in zip(got.logprobs[:common], alone.logprobs[:common]):
            assert abs(a.logprob - b.logprob) <= BF16_LOGPROB_TOL
        if common < len(got.token_ids):
            top = dict(alone.logprobs[common].top)
            parted = got.token_ids[common]
            assert parted in top, "parted on a token that was not a close second"
            assert top[alone.token_ids[common]] - top[parted] <= BF16_LOGPROB_TOL
    assert same >= 2, "most requests should not part at all"
