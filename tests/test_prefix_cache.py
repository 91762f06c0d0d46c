"""Prefix caching: shared full blocks across requests, never changing an output."""

from __future__ import annotations

import random

import pytest
import torch

from lucedesk.engine.kv_cache import BlockPool
from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import SamplingParams
from tests.engine_harness import Job, make_engine, run_jobs


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load_model(tiny_llama, torch.float32)


def vocab(loaded) -> list[int]:
    return [t for t in range(loaded.config.vocab_size) if t not in loaded.tokenizer.special_ids]


def test_lookup_never_covers_the_last_token_and_confirms_tokens():
    pool = BlockPool(8, 4, caching=True)
    blocks = pool.allocate(2)
    key = pool.register(blocks[0], None, [1, 2, 3, 4])
    pool.register(blocks[1], key, [5, 6, 7, 8])
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) == (blocks, False)
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7, 8]) == (blocks[:1], False)  # last token computed
    assert pool.lookup([1, 2, 3, 5, 5, 6, 7, 8, 9]) == ([], False)
    pool.free(blocks)
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 2
    hits, _ = pool.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9])
    pool.adopt(hits)  # taken back from the free list, counted once
    assert pool.num_free_blocks == 6
    pool.check_integrity([hits])


def test_eviction_takes_plain_blocks_first_then_least_recently_used():
    pool = BlockPool(4, 2, caching=True)
    a, b = pool.allocate(2)
    pool.register(a, None, [1, 1])
    pool.register(b, None, [2, 2])
    pool.free([a])
    pool.free([b])  # b freed last: most recently used
    taken = pool.allocate(3)
    assert taken[:2] == [2, 3]  # never-keyed blocks go first
    assert taken[2] == a and pool.num_evictions == 1
    assert pool.lookup([2, 2, 9]) == ([b], False) and pool.lookup([1, 1, 9]) == ([], False)


def chat_jobs(loaded, seed: int) -> list[Job]:
    """Multi-turn chats (each turn resends the history), forks of a shared system prompt,
    and unrelated requests, arriving over time."""
    rng = random.Random(seed)
    v = vocab(loaded)
    system = [rng.choice(v) for _ in range(70)]
    jobs = []
    history = list(system)
    for turn in range(4):  # one growing conversation
        history += [rng.choice(v) for _ in range(rng.randint(5, 30))]
        jobs.append(
            Job(
                list(history),
                SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                arrival_step=turn * 25,
            )
        )
        history += [rng.choice(v) for _ in range(12)]  # stands in for the reply
    for _ in range(5):  # forks off the same system prompt
        tail = [rng.choice(v) for _ in range(rng.randint(1, 40))]
        jobs.append(
            Job(
                system + tail,
                SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True),
                arrival_step=rng.randint(0, 60),
            )
        )
    for _ in range(3):
        prompt = [rng.choice(v) for _ in range(rng.randint(20, 150))]
        jobs.append(
            Job(
                prompt,
                SamplingParams(max_tokens=rng.randint(5, 40), temperature=0.0, ignore_eos=True),
                arrival_step=rng.randint(0, 60),
            )
        )
    return jobs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_identical_with_cache_on_and_off_under_pressure(loaded, seed):
    jobs = chat_jobs(loaded, seed)
    tight = dict(
        max_slots=3,
        block_size=16,
        kv_pool_tokens=352,
        max_num_batched_tokens=48,
        prefill_chunk_idle=32,
        prefill_chunk_decoding=16,
        decode_headroom_tokens=0,
    )
    off = make_engine(loaded, prefix_cache=False, **tight)
    on = make_engine(loaded, prefix_cache=True, **tight)
    assert run_jobs(on, jobs) == run_jobs(off, jobs)
    s = on.scheduler
    assert s.num_prefix_hit_tokens > 0
    assert s.num_computed_prompt_tokens < off.scheduler.num_computed_prompt_tokens
    assert s.pool.num_evictions > 0 or s.num_preemptions > 0
    assert off.scheduler.num_prefix_hit_tokens == 0


def test_fanout_of_eight_computes_the_shared_prefix_once(loaded):
    rng = random.Random(3)
    v = vocab(loaded)
    parent = [rng.choice(v) for _ in range(1000)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    jobs = [Job(parent + [rng.choice(v) for _ in range(10)], params) for _ in range(8)]
    engine = make_engine(
        loaded, max_slots=8, kv_pool_tokens=4096, max_model_len=1024, prefix_cache=True
    )
    outputs = run_jobs(engine, jobs)
    s = engine.scheduler
    # The parent's 1,000 tokens once, then each subagent's own tail and the part of the
    # parent's last block that is not full (1000 = 62 full blocks of 16 + 8 tokens).
    assert s.num_computed_prompt_tokens == 1010 + 7 * (8 + 10)
    assert s.num_prefix_hit_tokens == 7 * 62 * 16
    plain = make_engine(
        loaded, max_slots=8, kv_pool_tokens=16384, max_model_len=1024, prefix_cache=False
    )
    assert run_jobs(plain, jobs) == outputs
    assert plain.scheduler.num_computed_prompt_tokens == 8 * 1010


def test_stats_and_metrics_report_the_cache(loaded):
    from lucedesk.server.metrics import render

    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=1024).start()
    prompt = loaded.tokenizer.encode("the same long system prompt " * 12)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        engine.submit(prompt, params).result(timeout=20)
    engine.submit(prompt[:-1] + [prompt[-1]], params).result(timeout=20)
    stats = engine.stats()
    engine.shutdown()
    assert stats.prefix_cache_hit_tokens > 0 and stats.prefix_cached_blocks > 0
    assert stats.prefix_cache_queries >= 3 * len(prompt)
    text = render(stats)
    assert f"lucedesk_prefix_cache_hit_tokens_total {stats.prefix_cache_hit_tokens}" in text
