"""Prompt-lookup speculation: drafts from the request's own context, verified in the same
step as the other rows. It never changes an answer: greedy tokens are the same with and
without drafts, batched or alone, through preemption, stop strings and stop tokens."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lucedesk.chat import ChatEncoder, schema_grammar
from lucedesk.config import EngineConfig
from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import SamplingParams
from lucedesk.engine.speculation import PromptLookup
from lucedesk.errors import ConfigError, RequestError
from tests.engine_harness import Job, make_engine, random_jobs, run_alone, run_jobs, run_jobs_whole
from tests.test_engine_correctness import KERNELS, TIGHT, check_batched_equals_alone

# ------------------------------------------------------------------ the lookup itself


def test_a_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    lookup = PromptLookup()
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 6, 7, 3, 4]
    # suffix (3, 4): latest earlier occurrence at 8..9, followed by 6 7 3 4
    assert lookup.draft(tokens, 3) == [6, 7, 3]
    tokens += [6]  # suffix (3, 4, 6) now matches at 8..10 -> 7 3 4 6
    assert lookup.draft(tokens, 8) == [7, 3, 4, 6]
    assert lookup.draft(tokens, 0) == []
    assert PromptLookup().draft([5, 6, 7, 8], 4) == []  # nothing repeats
    assert PromptLookup().draft([5, 6, 5, 6], 4) == [5, 6]  # never itself: the earlier one
    assert PromptLookup().draft([5, 5], 4) == []  # single tokens do not count


def test_an_index_grown_step_by_step_drafts_as_a_fresh_one():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(40)]
    grown = PromptLookup()
    for n in range(1, len(tokens) + 1):
        assert grown.draft(tokens[:n], 5) == PromptLookup().draft(tokens[:n], 5)


# ------------------------------------------------------------------ engine: same tokens


def repetitive_jobs(loaded, num: int, seed: int, pressure: bool = True) -> list[Job]:
    """Prompts that repeat themselves (a segment three times, then a tail), so drafts are
    found in the prompt as well as in the output."""
    rng = random.Random(seed)
    jobs = random_jobs(loaded, num, seed, prompt_range=(4, 40), pressure=pressure)
    out = []
    for job in jobs:
        segment = job.prompt[: rng.randint(3, 12)]
        prompt = segment * 3 + job.prompt[len(segment) :]
        out.append(dataclasses.replace(job, prompt=prompt))
    return out


# Tiny random models whose greedy output falls into loops, so drafts from the output are
# both kept and refused (the llama one rarely repeats itself).
LOOPING = ["qwen2", "qwen3"]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", LOOPING)
@pytest.mark.parametrize("seed", [0, 1])
def test_drafts_change_no_greedy_token_batched_or_alone(tiny_models, arch, seed, kernels):
    """fp32, a pool small enough to force preemption: with drafts on, every request gets the
    tokens it gets alone with drafts off, and alone with them on."""
    loaded = load_model(tiny_models[arch], torch.float32)
    jobs = repetitive_jobs(loaded, 12, seed)
    engine = check_batched_equals_alone(loaded, jobs, kernels, prompt_lookup=True, **TIGHT)
    sched = engine.scheduler
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0, "no draft was run"
    plain = run_alone(loaded, jobs, kernels)
    assert run_alone(loaded, jobs, kernels, prompt_lookup=True) == plain


@pytest.mark.parametrize("kernels", KERNELS)
def test_drafts_change_no_sampled_token_batched_or_alone(tiny_models, kernels):
    """Seeded sampling (temperature, top-k, top-p): a draft token stands where the draw at
    its position chooses it, so the tokens are those drawn without drafts, alone."""
    loaded = load_model(tiny_models["qwen3"], torch.float32)
    jobs = repetitive_jobs(loaded, 12, 6)
    jobs = [
        dataclasses.replace(
            j, params=dataclasses.replace(j.params, temperature=0.7, top_k=40, top_p=0.95, seed=i)
        )
        for i, j in enumerate(jobs)
    ]
    engine = check_batched_equals_alone(loaded, jobs, kernels, prompt_lookup=True, **TIGHT)
    assert engine.scheduler.num_accepted_tokens > 0
    assert engine.scheduler.num_accepted_tokens < engine.scheduler.num_draft_tokens
    assert run_alone(loaded, jobs, kernels) == run_alone(loaded, jobs, kernels, prompt_lookup=True)


def test_drafts_change_no_constrained_token(tiny_models):
    """Grammar rows (a long regex, a JSON schema), greedy and seeded: each draft position is
    masked after the kept tokens before it, so the tokens are those without drafts, alone."""
    from lucedesk.engine import Grammar
    from tests.test_constrained import LONG, SCHEMA

    loaded = load_model(tiny_models["qwen3"], torch.float32)
    jobs = []
    for i, job in enumerate(repetitive_jobs(loaded, 10, 8)):
        grammar = Grammar.regex(LONG) if i % 2 else schema_grammar(SCHEMA)
        params = dataclasses.replace(job.params, grammar=grammar, max_tokens=64)
        if i % 3 == 0:
            params = dataclasses.replace(params, temperature=0.7, seed=i)
        jobs.append(dataclasses.replace(job, params=params))
    config = dict(TIGHT, max_num_batched_tokens=48, prefill_chunk_idle=32)
    config["kv_pool_tokens"] = 23 * 16
    engine = make_engine(loaded, prompt_lookup=True, **config)
    batched = run_jobs(engine, jobs)
    assert engine.scheduler.num_accepted_tokens > 0
    assert batched == run_alone(loaded, jobs)


def test_drafts_keep_every_answer_with_stop_strings_and_stop_tokens(tiny_models):
    """A stop string or stop token inside a step's accepted draft ends the request exactly
    where it ends without drafts: the same text, tokens and finish reason."""
    loaded = load_model(tiny_models["qwen3"], torch.float32)
    jobs = repetitive_jobs(loaded, 6, 5, pressure=False)
    config = dict(kernels="cpu", max_slots=4, kv_pool_tokens=4096)
    base = [
        dataclasses.replace(j, params=dataclasses.replace(j.params, max_tokens=48)) for j in jobs
    ]
    first = run_jobs_whole(make_engine(loaded, **config), base)
    stopped_jobs = []
    for job, done in zip(base, first):
        text, ids = done.text, list(done.token_ids)
        stop = (text[len(text) // 2 : len(text) // 2 + 3],) if len(text) > 8 else ()
        stop_ids = (ids[len(ids) * 2 // 3],)
        params = dataclasses.replace(job.params, stop=stop, stop_token_ids=stop_ids)
        stopped_jobs.append(dataclasses.replace(job, params=params))
    without = run_jobs_whole(make_engine(loaded, **config), stopped_jobs)
    engine = make_engine(loaded, prompt_lookup=True, **config)
    with_drafts = run_jobs_whole(engine, stopped_jobs)
    assert engine.scheduler.num_accepted_tokens > 0
    for a, b in zip(without, with_drafts):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    assert any(c.finish_reason == "stop" for c in without)


def test_q4_weights_and_drafts_give_the_tokens_alone(tmp_path):
    """bf16 with 4-bit weights (the CPU profile's format): drafts on, batched, against
    drafts off, alone."""
    from gguf import GGMLQuantizationType as Q

    from tests.gguf_writer import write_gguf

    path = write_gguf(
        tmp_path / "q4.gguf",
        {
            k: Q.Q4_0
            for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        },
    )
    loaded = load_model(path, torch.bfloat16)
    jobs = repetitive_jobs(loaded, 6, 2, pressure=False)
    engine = make_engine(
        loaded, kernels="cpu", weights="q4", max_slots=4, kv_pool_tokens=4096, prompt_lookup=True
    )
    batched = run_jobs(engine, jobs)
    assert engine.scheduler.num_accepted_tokens > 0
    assert batched == run_alone(loaded, jobs, "cpu", "q4")


# ------------------------------------------------------------------ who gets drafts


def test_the_request_switch_overrides_the_engine_default(tiny_models):
    loaded = load_model(tiny_models["qwen3"], torch.float32)
    job = repetitive_jobs(loaded, 1, 3, pressure=False)[0]

    def drafted(params: SamplingParams, **config) -> int:
        engine = make_engine(loaded, max_slots=2, kv_pool_tokens=2048, **config)
        run_jobs(engine, [Job(job.prompt, params)])
        return engine.scheduler.num_draft_tokens

    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert drafted(greedy) == 0  # off by default
    assert drafted(greedy, prompt_lookup=True) > 0
    assert drafted(dataclasses.replace(greedy, speculative=False), prompt_lookup=True) == 0
    assert drafted(dataclasses.replace(greedy, speculative=True)) > 0
    sampled = dataclasses.replace(greedy, temperature=0.2, seed=1, speculative=True)
    assert drafted(sampled) > 0
    # Requests asking for logprobs go without (their tokens come one a step).
    assert drafted(dataclasses.replace(greedy, logprobs=2, speculative=True)) == 0


def test_speculation_settings_are_checked():
    with pytest.raises(ConfigError, match="prompt_lookup_tokens must be an integer from 1 to 64"):
        EngineConfig(prompt_lookup_tokens=0).validate()
    with pytest.raises(RequestError, match="speculative must be true, false or null"):
        SamplingParams(speculative="yes").validate()


def test_stats_count_drafts(tiny_models):
    loaded = load_model(tiny_models["qwen3"], torch.float32)
    jobs = repetitive_jobs(loaded, 3, 4, pressure=False)
    engine = make_engine(loaded, max_slots=4, kv_pool_tokens=4096, prompt_lookup=True)
    run_jobs(engine, jobs)
    engine._publish(0)
    stats = engine.stats()
    sched = engine.scheduler
    assert stats.draft_tokens == sched.num_draft_tokens > 0
    assert stats.accepted_tokens == sched.num_accepted_tokens
    assert 0 < stats.acceptance_rate <= 1
    assert stats.tokens_per_draft_row == 1 + stats.accepted_tokens / stats.draft_rows


# ------------------------------------------------------------------ real text

SOURCE = '''def merge(left, right):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out


def merge_sort(items):
    """Sort a list with merge sort."""
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    return merge(merge_sort(items[:middle]), merge_sort(items[middle:]))
'''


@pytest.mark.default_model
def test_the_default_model_quoting_code_keeps_its_text_in_fewer_steps(default_model):
    """The case drafts are for: the real model asked to repeat a function writes the same
    text with drafts on, most drafted tokens kept, in far fewer engine steps."""
    loaded = load_model(default_model, torch.bfloat16)
    messages = [{"role": "user", "content": f"Repeat this code exactly:\n\n{SOURCE}"}]
    params = SamplingParams(max_tokens=200, temperature=0.0)
    results = {}
    for on in (False, True):
        engine = make_engine(loaded, kernels="cpu", weights="auto", prompt_lookup=on)
        handle = engine.submit(ChatEncoder.of(engine).encode(messages).token_ids, params)
        steps = 0
        while not handle.finished:
            engine.step()
            steps += 1
        results[on] = (handle.result(timeout=0), steps, engine.scheduler)
    (plain, plain_steps, _), (drafted, drafted_steps, sched) = results[False], results[True]
    assert drafted.text == plain.text and drafted.token_ids == plain.token_ids
    quoted = SOURCE[SOURCE.index("def merge_sort") : SOURCE.index("    return merge(merge_")]
    assert quoted in plain.text  # it did quote the code (which function first is a near tie)
    assert sched.num_accepted_tokens >= 0.5 * sched.num_draft_tokens
    assert drafted_steps <= 0.6 * plain_steps, (drafted_steps, plain_steps)
