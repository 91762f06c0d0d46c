"""Batching changes no output: every request's tokens equal those of running it alone (fp32,
CPU), with requests arriving at different steps, three slots, a small budget, small chunks and
a KV pool small enough to force preemption and recomputation; with the K/V cache in the model
dtype and at 8 bits (a stored row depends only on its own token, so this holds there too)."""

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
KV_DTYPES = ["dtype", "int8"]

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
    same = {k: v for k, v in config.items() if k.startswith("prompt_lookup") or k == "kv_dtype"}
    alone = run_alone(loaded, jobs, kernels, weights, **same)
    for i, (got, want) in enumerate(zip(batched, alone)):
        assert got == want, f"request {i} (prompt {len(jobs[i].prompt)} tokens) differs"
        assert len(got) == jobs[i].params.max_tokens
    assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks
    return engine


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_batched_equals_alone_tiny(tiny_models, arch, seed, kernels, kv_dtype):
    loaded = load_model(tiny_models[arch], torch.float32)
    jobs = random_jobs(loaded, 14, seed)
    # Seed 1 paces its prompt chunks from the steps' times: chunks that vary run to run.
    paced = dict(decode_slowdown=2.0, prefill_chunk_idle=24) if seed else {}
    check_batched_equals_alone(loaded, jobs, kernels, kv_dtype=kv_dtype, **(TIGHT | paced))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_seeded_sampling_batched_equals_alone_tiny(tiny_models, arch, kernels, kv_dtype):
    loaded = load_model(tiny_models[arch], torch.float32)
    jobs = random_jobs(loaded, 14, 0, sampled=True)
    check_batched_equals_alone(loaded, jobs, kernels, kv_dtype=kv_dtype, **TIGHT)


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
    # The 8-bit cache here: prefix hits and drafts read rows written by other requests' steps.
    config = dict(TIGHT, prefix_cache=prefix_cache, prompt_lookup=prompt_lookup, kv_dtype="int8")
    engine = check_batched_equals_alone(loaded, jobs, "cpu", **config)
    scheduler = engine.scheduler
    if prompt_lookup:
        assert scheduler.num_draft_rows > 0 and scheduler.num_accepted_tokens > 0
    assert (scheduler.num_prefix_hit_tokens > 0) == prefix_cache


# On the default model, fewer random requests than on the tiny models (each of its steps
# costs ~50x theirs): the three that force preemption plus these, still arriving at
# different steps; the tiny models above run fourteen per seed and setting.
DEFAULT_MODEL_JOBS = 6


@pytest.mark.default_model
@pytest.mark.parametrize("kernels", KERNELS)
def test_greedy_batched_equals_alone_default_model(default_model, kernels):
    loaded = load_model(default_model, torch.float32)
    jobs = random_jobs(loaded, DEFAULT_MODEL_JOBS, 3)
    check_batched_equals_alone(loaded, jobs, kernels, **TIGHT)


# Batched against alone with the 8-bit cache on the default model: fp32 matmuls over other
# rows of a batch round a token's K/V differently in the last bit (below 1e-6 in a logprob
# with model-dtype K/V), and at 8 bits such a difference can move a value across a rounding
# boundary, thirty layers deep. So here, as in bf16, tokens agree up to a close second: every
# logprob within the stated tolerance's p99 (tests/test_kv_int8.py) up to any parting, and
# there the two candidates within it too. Exact on the tiny models above.
KV8_LOGPROB_TOL = 0.3


@pytest.mark.default_model
def test_int8_kv_batched_matches_alone_default_model(default_model):
    from tests.engine_harness import Job, run_jobs_whole

    loaded = load_model(default_model, torch.float32)
    jobs = [
        Job(j.prompt, replace(j.params, logprobs=2), j.arrival_step)
        for j in random_jobs(loaded, DEFAULT_MODEL_JOBS, 3)
    ]
    largest = max(len(j.prompt) + j.params.max_tokens for j in jobs)
    config = dict(TIGHT, kernels="cpu", kv_dtype="int8")
    config["kv_pool_tokens"] = blocks_for(largest, 16) * 16
    engine = make_engine(loaded, **config)
    batched = run_jobs_whole(engine, jobs)
    assert engine.scheduler.num_preemptions > 0
    alone = [
        run_jobs_whole(
            make_engine(loaded, **dict(config, max_slots=1, kv_pool_tokens=4096)),
            [Job(job.prompt, job.params)],
            check=False,
        )[0]
        for job in jobs
    ]
    assert identical_up_to_near_ties(batched, alone, KV8_LOGPROB_TOL) >= len(jobs) // 2


@pytest.mark.default_model
@pytest.mark.parametrize("kernels", KERNELS)
def test_seeded_sampling_batched_equals_alone_default_model(default_model, kernels):
    loaded = load_model(default_model, torch.float32)
    jobs = random_jobs(loaded, DEFAULT_MODEL_JOBS, 0, sampled=True)
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


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_r9700_profile_bf16_triton_batched_matches_alone(tiny_llama, kv_dtype):
    """The settings the R9700 runs (Triton kernels, bf16, its block size, budget and chunk
    sizes), on the CPU in Triton's interpreter with a tiny model and a pool shrunk to force
    preemption: batched equals alone within bf16's tolerance, with either KV format."""
    import dataclasses

    from lucedesk.engine.build import assemble
    from lucedesk.profile import all_profiles
    from tests.engine_harness import Job, run_jobs_whole

    r9700 = all_profiles()["r9700"].engine
    loaded = load_model(tiny_llama, torch.bfloat16)
    # Prompts of one block and no headroom: three fit the three-block pool at once and each
    # grows into a second block, so preemption comes within a few steps (the interpreter
    # makes every step dear: ~0.1 s a kernel program).
    jobs = random_jobs(
        loaded, 4, seed=7, prompt_range=(8, 16), output_range=(12, 16), pressure=False
    )
    jobs = [Job(j.prompt, dataclasses.replace(j.params, logprobs=2), arrival_step=0) for j in jobs]
    small = dataclasses.replace(
        r9700,
        device="cpu",
        kv_pool_tokens=3 * 16,
        decode_headroom_tokens=0,
        max_model_len=1024,
        kv_dtype=kv_dtype,
    )
    engine = assemble(loaded, small, torch.device("cpu")).engine
    assert engine.seq_engine.kernels.name == "triton" and loaded.model.dtype == torch.bfloat16
    batched = run_jobs_whole(engine, jobs)
    assert engine.scheduler.num_preemptions > 0
    roomy = dataclasses.replace(small, kv_pool_tokens=4096, max_slots=1)
    alone = [
        run_jobs_whole(
            assemble(loaded, roomy, torch.device("cpu")).engine,
            [Job(job.prompt, job.params)],
            check=False,
        )[0]
        for job in jobs
    ]
    assert identical_up_to_near_ties(batched, alone, BF16_LOGPROB_TOL) >= 2


def identical_up_to_near_ties(batched, alone, tol: float) -> int:
    """Each batched completion against the same request alone: every token's logprob within
    `tol` up to the first parting, and there the alone run's top two (a near tie in
    logprob) within `tol`. Returns how many did not part at all."""
    same = 0
    for got, want in zip(batched, alone):
        assert len(got.token_ids) == len(want.token_ids)
        common = next(
            (i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
            len(got.token_ids),
        )
        same += common == len(got.token_ids)
        for a, b in zip(got.logprobs[:common], want.logprobs[:common]):
            assert abs(a.logprob - b.logprob) <= tol
        if common < len(got.token_ids):
            top = dict(want.logprobs[common].top)
            parted = got.token_ids[common]
            assert parted in top, "parted on a token that was not a near tie with the one alone"
            assert top[want.token_ids[common]] - top[parted] <= tol
    return same
