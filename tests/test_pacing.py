"""Stall-free steps and no starving: the pacer and the scheduler fed with step times from a
cost model (what a CPU's steps cost), no model and no clock."""

from __future__ import annotations

import statistics

import pytest

from lucedesk.config import EngineConfig
from lucedesk.engine.pacing import StepPacer
from lucedesk.engine.plan import StepPlan
from lucedesk.engine.request import Phase, Request, SamplingParams
from lucedesk.engine.scheduler import Scheduler

ALONE = 0.011  # a decode-only step of one stream (the default model on this machine)


def step_cost(plan: StepPlan) -> float:
    """Seconds a step takes: a fixed part, 0.2 ms a decode token, and for each prompt token
    0.3 ms plus attention over the tokens before it (20 ns a position)."""
    cost = ALONE + 0.0002 * sum(r.num_tokens for r in plan.decodes)
    for row in plan.prefills:
        cost += row.num_tokens * (0.0003 + 2e-8 * (row.start + row.num_tokens / 2))
    return cost


def request(rid: str, prompt: int, max_tokens: int, interactive: bool = False) -> Request:
    base = 1000 + 1000 * len(rid)  # no two prompts here share a prefix
    req = Request(rid, [base + i % 500 for i in range(prompt)], SamplingParams(max_tokens))
    req.interactive = interactive
    return req


def paced_config(**kw) -> EngineConfig:
    """The `cpu` profile's chunks (512 while idle, 256 fixed while something decodes),
    paced at 2x."""
    base = dict(
        block_size=16,
        max_num_batched_tokens=512,
        prefill_chunk_idle=512,
        prefill_chunk_decoding=256,
        decode_slowdown=2.0,
    )
    return EngineConfig(**{**base, **kw})


def run(sched: Scheduler, plans: list[StepPlan], until) -> None:
    while not until():
        plan = sched.plan()
        sched.observe(plan, step_cost(plan))
        sampled = {r.request.slot: 7 for r in plan.rows if r.sample}
        sched.update(plan, sampled)
        sched.check_integrity()
        plans.append(plan)
        assert len(plans) < 100_000


def streaming(sched: Scheduler, tokens: int, max_tokens: int = 3000) -> list[StepPlan]:
    """A 20-token stream added to `sched` and stepped until it has `tokens` output tokens:
    the steps' plans so far."""
    stream = request("stream", 20, max_tokens)
    sched.add(stream)
    plans: list[StepPlan] = []
    run(sched, plans, lambda: stream.num_output_tokens >= tokens)
    return plans


def test_pacer_sizes_the_chunk_from_timed_steps():
    pacer = StepPacer(2.0, least=16, most=512)
    assert pacer.chunk(1) == 0  # nothing timed yet: a decode-only step, to time it
    pacer.observe(1, 16, 0.02)  # (a mixed step says nothing before one is timed)
    assert pacer.chunk(1) == 0 and pacer.per_token is None
    pacer.observe(1, 0, 0.010)
    assert pacer.chunk(1) == 16  # no mixed step timed yet
    pacer.observe(1, 16, 0.010 + 16 * 0.0005)
    assert pacer.chunk(1) == 20  # (2 - 1) * 10 ms / 0.5 ms
    assert pacer.chunk(12) == 20  # 8-15 decode tokens not timed: one's time stands in
    pacer.observe(12, 0, 0.020)
    assert pacer.chunk(12) == 40
    for _ in range(50):  # the prompt tokens grow cheaper (a GPU): the chunk grows to `most`
        pacer.observe(1, 20, 0.010 + 20 * 0.00001)
    assert pacer.chunk(1) == 512
    for _ in range(50):  # ...and dearer: down to `least`
        pacer.observe(1, 16, 0.010 + 16 * 0.01)
    assert pacer.chunk(1) == 16
    with pytest.raises(ValueError):
        StepPacer(1.0, 16, 512)


@pytest.mark.parametrize(("slowdown", "floor_ms"), [(1.5, 0), (2.0, 0), (3.0, 0), (2.0, 40)])
def test_a_stream_keeps_its_time_per_token_while_a_long_prompt_prefills(slowdown, floor_ms):
    """One stream decodes while a 6,000-token prompt arrives: with paced chunks its steps
    stay within `slowdown` times a decode-only step, or the floor where that is more (after
    the first few, which learn the cost), where the fixed 256-token chunk made them ~8x;
    the prompt still finishes."""
    config = paced_config(max_slots=4, decode_slowdown=slowdown, decode_step_ms=floor_ms)
    sched = Scheduler(config, num_blocks=1000, max_model_len=10_000)
    plans = streaming(sched, 20)
    long = request("long", 6000, 4)
    sched.add(long)
    mixed: list[float] = []
    run(sched, plans, lambda: long.num_output_tokens > 0)
    for plan in plans[-(len(plans) - 21) :]:
        if plan.decodes and plan.prefills:
            mixed.append(step_cost(plan))
    alone = step_cost(plans[10])  # a decode-only step of the stream
    assert len(mixed) > 20
    target = max(slowdown * alone, floor_ms / 1000)
    assert max(mixed[5:]) <= target * 1.1
    assert statistics.median(mixed) >= target * 0.8  # and the prompt uses what it may
    # Fixed chunks: the same prompt's steps cost ~8 times a decode-only one.
    fixed = Scheduler(config.replace(decode_slowdown=0), num_blocks=1000, max_model_len=10_000)
    plans = streaming(fixed, 20)
    long = request("long", 6000, 4)
    fixed.add(long)
    run(fixed, plans, lambda: long.num_output_tokens > 0)
    assert max(step_cost(p) for p in plans if p.decodes and p.prefills) > 7 * alone


def test_a_burst_runs_whole_chunks_and_a_prompt_after_it_is_paced():
    """Eight requests that come together (a bench's burst, subagents started at once): the
    first one's stream does not pace the others' prompts, which run the fixed chunk each
    step beside it until every one has its first token; a prompt that comes once they
    stream is paced for them."""
    config = paced_config(max_slots=9)
    sched = Scheduler(config, num_blocks=2000, max_model_len=10_000)
    burst = [request(f"b{i}" + "x" * i, 300, 400) for i in range(8)]
    for req in burst:
        sched.add(req)
    plans: list[StepPlan] = []
    run(sched, plans, lambda: all(r.num_output_tokens for r in burst))
    prompt_tokens = [sum(r.num_tokens for r in p.prefills) for p in plans if p.decodes]
    assert prompt_tokens and all(n == 256 for n in prompt_tokens[:-1])
    assert len(plans) == 1 + -(-(8 * 300 - 512) // 256)  # no step beside them went short
    late = request("late", 3000, 4)
    sched.add(late)
    mixed: list[float] = []
    start = len(plans)
    run(sched, plans, lambda: late.num_output_tokens > 0)
    mixed = [step_cost(p) for p in plans[start:] if p.decodes and p.prefills]
    alone = max(step_cost(p) for p in plans[start:] if p.decodes and not p.prefills)
    assert len(mixed) > 5 and max(mixed[2:]) <= 2.0 * alone * 1.1


def test_a_prompt_that_comes_with_a_streams_first_token_runs_whole_chunks_and_one_after_is_paced():
    """The boundary: a prompt that joins right after the step that gave a stream its first
    token came with it (it was in the engine's inbox while that step ran) and runs the
    fixed chunk beside it; one that joins a step later is paced for it."""
    sched = Scheduler(paced_config(max_slots=3), num_blocks=1000, max_model_len=10_000)
    plans = streaming(sched, 1, max_tokens=100)
    with_it = request("with-it", 2000, 4)
    sched.add(with_it)
    run(sched, plans, lambda: len(plans) == 2)
    assert [r.num_tokens for r in plans[-1].prefills] == [256]  # the fixed chunk
    after = request("after", 2000, 4)
    sched.add(after)
    run(sched, plans, lambda: len(plans) == 3)
    assert sum(r.num_tokens for r in plans[-1].prefills) < 256  # paced: nothing timed yet


def test_a_watched_stream_keeps_its_pace_beside_a_prompt_that_came_with_it():
    """A watched (interactive) stream is paced for every prompt, even one that came with it
    (a pane's reply and a subagent's long prompt at once)."""
    sched = Scheduler(paced_config(max_slots=2), num_blocks=1000, max_model_len=10_000)
    watched = request("watched", 20, 400, interactive=True)
    long = request("long", 3000, 4)
    sched.add(watched)
    sched.add(long)
    plans: list[StepPlan] = []
    run(sched, plans, lambda: long.num_output_tokens > 0)
    mixed = [step_cost(p) for p in plans if p.decodes and p.prefills]
    alone = min(step_cost(p) for p in plans if p.decodes and not p.prefills)
    assert len(mixed) > 5 and max(mixed[2:]) <= 2.0 * alone * 1.1


def test_no_running_request_goes_background_every_steps_without_a_row():
    """Focus priority and long prompts at once: a watched stream decodes, an older long
    prompt takes every step's chunk, and a younger prompt and a background stream wait
    behind them; each still runs at least once every `background_every` steps."""
    k = 5
    config = paced_config(
        max_slots=5,
        max_num_batched_tokens=256,
        prefill_chunk_idle=256,
        prefill_chunk_decoding=64,
        background_every=k,
    )
    sched = Scheduler(config, num_blocks=2000, max_model_len=20_000)
    watched = request("watched", 10, 2000, interactive=True)
    background = request("background", 10, 2000)
    sched.add(watched)
    sched.add(background)
    plans: list[StepPlan] = []
    run(sched, plans, lambda: watched.phase is Phase.DECODE and background.phase is Phase.DECODE)
    older = request("older", 8000, 4, interactive=True)  # the watched pane's next prompt
    younger = request("younger", 300, 4)
    sched.add(older)
    sched.add(younger)
    last = {}
    run(sched, plans, lambda: younger.finished)
    for plan in plans:
        for row in plan.rows:
            rid = row.request.request_id
            if rid in last:
                assert plan.step - last[rid] <= k, (rid, plan.step, last[rid])
            last[rid] = plan.step
    assert {"watched", "background", "older", "younger"} <= set(last)
    assert not older.finished  # the younger prompt did not wait for the older one's end


def test_the_engine_times_its_steps_for_the_pacer_and_the_monitor(tiny_models):
    """An engine on a real model feeds the pacer its steps' times, and every busy slot's
    stats say when a step last ran it."""
    import torch

    from lucedesk.engine.models.loader import load_model
    from tests.engine_harness import Job, make_engine, run_jobs

    loaded = load_model(tiny_models["llama"], torch.float32)
    engine = make_engine(loaded, max_slots=2, decode_slowdown=2.0, kv_pool_tokens=2048)
    stream = engine.submit([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.pacer.alone(1) is not None  # decode-only steps were timed
    run_jobs(engine, [Job([10 + i % 300 for i in range(400)], SamplingParams(max_tokens=2), 0)])
    assert engine.scheduler.pacer.per_token is not None  # ...and one beside a prompt
    busy = [s for s in engine.stats().slots if s.request_id is not None]
    assert busy and all(s.progress_time is not None and s.wait_s is not None for s in busy)
    stream.cancel()
