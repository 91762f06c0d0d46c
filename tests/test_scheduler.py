"""The scheduling policy with plain Python objects: hundreds of randomized runs, invariants
checked after every step, plus the rules one by one."""

from __future__ import annotations

import random
import sys
import zlib

import pytest

from lucedesk.config import EngineConfig
from lucedesk.engine.kv_cache import BlockPool, blocks_for
from lucedesk.engine.request import FinishReason, Phase, Request, SamplingParams
from lucedesk.engine.scheduler import Scheduler
from lucedesk.engine.speculation import PromptLookup
from lucedesk.errors import RequestError


def test_policy_modules_import_no_torch():
    import subprocess

    code = (
        "import sys; import lucedesk.engine.scheduler, lucedesk.engine.kv_cache, "
        "lucedesk.engine.request; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    stop: int | None = None,
    prefix: list[int] | None = None,
) -> Request:
    """Distinct prompts per request id, unless a shared `prefix` is given."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    base = 10_000 + zlib.crc32(rid.encode()) % 1000 * 1000
    prompt = (prefix or []) + list(range(base, base + prompt_len))
    stop_ids = frozenset([stop] if stop is not None else [])
    return Request(rid, prompt[: max(prompt_len, len(prefix or []))], params, stop_ids=stop_ids)


def fake_token(req: Request) -> int:
    """A deterministic 'model': the next token depends on the request and its length."""
    return (zlib.crc32(req.request_id.encode()) + req.num_tokens * 7919) % 1000 + 1000


def streaming_before(plan, prompts: list[Request]) -> bool:
    """Whether a decode row of `plan` is watched or streamed before the newest of
    `prompts` came."""
    newest = max((r.arrival_step for r in prompts), default=None)
    return newest is not None and any(
        row.request.interactive
        or (row.request.first_token_step is not None and row.request.first_token_step < newest)
        for row in plan.decodes
    )


def run_step(sched: Scheduler, admitted: list[str] | None = None) -> list:
    """One step, its invariants checked; `admitted` gathers request ids in the order they
    first held a slot."""
    last_run = {r.request_id: r.scheduled_step for r in sched.running}
    # The prompts in line when the step's chunk is sized: those running and waiting, less
    # the cancelled (gone first), with the streams the step preempts (in the queue again).
    in_line = [
        r
        for r in sched.running + list(sched.waiting)
        if r.phase in (Phase.PREFILL, Phase.WAITING, Phase.PREEMPTED) and not r.cancel_requested
    ]
    plan = sched.plan()
    in_line += [r for r in sched.waiting if r not in in_line]
    if admitted is not None:
        admitted += [r.request_id for r in sched.running if r.request_id not in admitted]
    config = sched.config
    # Budget and chunk limits.
    assert plan.num_tokens <= config.max_num_batched_tokens
    # A prompt that waited background_every steps may run a block beyond the chunk.
    overdue = sum(
        min(r.num_tokens, config.block_size)
        for r in plan.prefills
        if plan.step - last_run.get(r.request.request_id, plan.step) >= config.background_every
    )
    prefill_tokens = sum(r.num_tokens for r in plan.prefills) - overdue
    if not plan.decodes:
        cap = config.prefill_chunk_idle
    elif sched.pacer is None or not streaming_before(plan, in_line):
        cap = config.prefill_chunk_decoding
    else:
        cap = sched.pacer.chunk(plan.num_tokens - sum(r.num_tokens for r in plan.prefills))
    assert prefill_tokens <= cap
    seen = set()
    for row in plan.rows:
        req = row.request
        assert req.slot is not None, "a scheduled request without a slot"
        assert req.request_id not in seen, "a request scheduled twice in one step"
        seen.add(req.request_id)
        # No slot without the blocks its tokens need.
        assert len(req.block_ids) * config.block_size >= row.start + row.num_tokens
        assert row.start == req.num_computed_tokens
    for row in plan.decodes:
        assert row.request.phase is Phase.DECODE and row.num_tokens == 1
    # Nobody starves: a running request has had a row within background_every steps (where
    # the budget holds a block for every slot).
    if config.max_num_batched_tokens >= config.max_slots * (config.block_size + 1):
        for req in sched.running:
            assert plan.step - req.scheduled_step < config.background_every, req.request_id
    sampled = {r.request.slot: fake_token(r.request) for r in plan.rows if r.sample}
    # A paced scheduler is told what the step cost: 10 ms, plus 0.5 ms a token.
    sched.observe(plan, 0.01 + 0.0005 * plan.num_tokens)
    sched.update(plan, sampled)
    sched.check_integrity()
    return plan


def random_case(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([8, 16])
    slots = rng.randint(1, 5)
    budget = rng.randint(slots, 64)
    config = EngineConfig(
        max_slots=slots,
        block_size=block_size,
        max_num_batched_tokens=budget,
        prefill_chunk_idle=rng.randint(1, 64),
        prefill_chunk_decoding=rng.randint(1, 16),
        decode_headroom_tokens=rng.choice([0, 1, 8]),
        prefix_cache=rng.random() < 0.7,
        background_every=rng.choice([1, 2, 6]),
        decode_slowdown=rng.choice([0, 1.5, 2.0]),
    )
    shared = [rng.randrange(1000) for _ in range(rng.choice([0, 8, 40]))]
    num_blocks = rng.randint(8, 40)
    sched = Scheduler(config, num_blocks=num_blocks, max_model_len=10_000)
    pending = []
    for i in range(rng.randint(1, 25)):
        prompt = rng.randint(1, 120)
        out = rng.randint(1, 40)
        if blocks_for(prompt + out, config.block_size) > num_blocks:
            with pytest.raises(RequestError):
                sched.add(make_request(f"r{i}", prompt, out))
            continue
        stop = 1000 + rng.randrange(1000) if rng.random() < 0.3 else None
        prefix = shared if rng.random() < 0.5 else None
        req = make_request(f"r{i}", prompt, out, stop, prefix)
        req.interactive = rng.random() < 0.3  # watched: the others may skip steps
        if blocks_for(req.num_prompt_tokens + out, config.block_size) > num_blocks:
            continue
        pending.append((rng.randint(0, 30), req))
    pending.sort(key=lambda p: p[0])
    all_reqs = [r for _, r in pending]
    first_admitted: list[str] = []
    step = 0
    while pending or sched.running or sched.waiting:
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        # Random cancellations, in any phase.
        for req in all_reqs:
            if not req.finished and rng.random() < 0.01:
                req.cancel_requested = True
        run_step(sched, first_admitted)
        step += 1
        assert step < 20_000, "the scheduler stopped making progress"
    # Every request ended, and every block came back.
    assert all(r.finished for r in all_reqs)
    assert sched.pool.num_free_blocks == num_blocks
    assert sorted(sched.free_slots) == list(range(slots))
    for r in all_reqs:
        assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED)
        if r.finish_reason is FinishReason.LENGTH:
            assert r.num_output_tokens == r.params.max_tokens
    # Strict FIFO: requests were first admitted in arrival order.
    arrival = [r.request_id for r in all_reqs if r.request_id in first_admitted]
    assert first_admitted == arrival


@pytest.mark.parametrize("seed", range(300))
def test_randomized_invariants(seed):
    random_case(seed)


def config(**kw) -> EngineConfig:
    base = dict(
        max_slots=2,
        block_size=8,
        max_num_batched_tokens=32,
        prefill_chunk_idle=32,
        prefill_chunk_decoding=4,
        decode_headroom_tokens=0,
    )
    base.update(kw)
    return EngineConfig(**base)


def test_a_watched_request_decodes_every_step_and_no_background_one_stops():
    """While an interactive request decodes, background ones join every background_every-th
    step (decode rows and prompt chunks alike); once it ends, every step again."""
    sched = Scheduler(config(max_slots=4, background_every=3), num_blocks=64, max_model_len=1000)
    watched = make_request("watched", 4, 30)
    watched.interactive = True
    background = [make_request(f"bg{i}", 4, 60) for i in range(3)]
    for req in [watched, *background]:
        sched.add(req)
    steps: list[set[str]] = []
    while not watched.finished:
        plan = run_step(sched)
        steps.append({r.request.request_id for r in plan.rows})
    decoding = [s for s in steps if "watched" in s]
    assert len(decoding) == len(steps)  # every step, from its first
    gaps = [i for i, s in enumerate(steps) if "bg0" in s]
    assert max(b - a for a, b in zip(gaps, gaps[1:])) <= 3  # never more than 3 apart
    assert len(gaps) < len(steps) / 2  # ...and not every step
    progress = [r.num_output_tokens for r in background]
    plan = run_step(sched)  # nothing watched now: everyone, every step
    assert {r.request.request_id for r in plan.decodes} == {"bg0", "bg1", "bg2"}
    assert all(r.num_output_tokens == p + 1 for r, p in zip(background, progress))


def test_while_a_request_is_watched_only_interactive_rows_draft():
    """Background rows that join a watched stream's step take no drafts (that step stays
    light); the watched one drafts throughout, and the background drafts again after."""
    cfg = config(max_slots=4, background_every=2, max_num_batched_tokens=64)
    sched = Scheduler(cfg, num_blocks=64, max_model_len=1000)
    period = [7, 8, 9, 10, 11]  # every prompt repeats it: lookup always finds a draft

    def drafting(rid: str, max_tokens: int, interactive: bool) -> Request:
        req = Request(rid, period * 4, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        req.lookup, req.draft_limit, req.interactive = PromptLookup(), 4, interactive
        return req

    watched = drafting("watched", 12, True)
    background = [drafting(f"bg{i}", 200, False) for i in range(3)]
    for req in [watched, *background]:
        sched.add(req)
    watched_rows, joined, after = [], [], []  # each row: drafted or not
    while len(after) < 12:
        plan = sched.plan()
        watching = any(row.request is watched for row in plan.decodes)
        for row in plan.decodes:
            if row.request is watched:
                watched_rows.append(bool(row.draft))
            else:
                (joined if watching else after).append(bool(row.draft))
        # The model continues the period and takes none of a draft.
        sampled = {
            row.request.slot: period[
                (row.start + (1 if row in plan.decodes else row.num_tokens)) % 5
            ]
            for row in plan.rows
            if row.sample
        }
        sched.update(plan, sampled)
    # The watched stream drafts on every row but its last (one token left: none to draft).
    assert watched_rows == [True] * 10 + [False]
    assert joined and not any(joined)  # the background joined, without drafts
    assert all(after)  # nobody watched: drafts again


def test_decode_rows_first_then_chunks_oldest_first():
    sched = Scheduler(config(max_slots=3), num_blocks=32, max_model_len=1000)
    a = make_request("a", 5, 10)
    sched.add(a)
    run_step(sched)  # a's whole prompt (idle chunk is large)
    assert a.phase is Phase.DECODE
    b, c = make_request("b", 10, 5), make_request("c", 10, 5)
    sched.add(b)
    sched.add(c)
    plan = run_step(sched)
    assert [r.request.request_id for r in plan.decodes] == ["a"]
    # While something decodes, prompt work is capped at the small chunk, oldest first.
    assert [(r.request.request_id, r.num_tokens) for r in plan.prefills] == [("b", 4)]


def test_several_prompts_share_a_step():
    sched = Scheduler(config(max_slots=3), num_blocks=32, max_model_len=1000)
    for rid in "abc":
        sched.add(make_request(rid, 10, 5))
    plan = run_step(sched)
    assert [(r.request.request_id, r.num_tokens) for r in plan.prefills] == [
        ("a", 10),
        ("b", 10),
        ("c", 10),
    ]


def test_big_head_is_not_overtaken():
    sched = Scheduler(config(max_slots=3), num_blocks=10, max_model_len=1000)
    small1 = make_request("s1", 40, 30)  # 5 blocks reserved for its prompt
    sched.add(small1)
    run_step(sched)
    big = make_request("big", 60, 10)  # needs 8 blocks: does not fit beside s1
    small2 = make_request("s2", 4, 2)  # would fit, but must wait behind big
    sched.add(big)
    sched.add(small2)
    for _ in range(3):
        run_step(sched)
        assert big.slot is None and small2.slot is None


def test_preemption_takes_the_newest_and_recomputes():
    sched = Scheduler(config(max_slots=2), num_blocks=4, max_model_len=1000)
    old, new = make_request("old", 8, 20), make_request("new", 8, 20)
    sched.add(old)
    sched.add(new)
    while not new.num_preemptions:
        run_step(sched)
    assert old.slot is not None and old.num_preemptions == 0
    assert new.phase is Phase.PREEMPTED and not new.block_ids
    assert sched.waiting[0] is new
    generated = list(new.output_ids)
    while not (old.finished and new.finished):
        run_step(sched)
    assert new.output_ids[: len(generated)] == generated  # kept across the recompute
    assert new.num_output_tokens == 20


@pytest.mark.parametrize("phase", ["waiting", "prefill", "decode"])
def test_cancel_in_every_phase_returns_blocks(phase):
    sched = Scheduler(config(max_slots=1, prefill_chunk_idle=4), num_blocks=16, max_model_len=1000)
    blocker = make_request("blocker", 4, 3)
    req = make_request("r", 12, 10)
    if phase == "waiting":
        sched.add(blocker)
        run_step(sched)
    sched.add(req)
    while req.phase.value != phase:
        run_step(sched)
    req.cancel_requested = True
    run_step(sched)
    assert req.finish_reason is FinishReason.CANCELLED
    assert req.slot is None and not req.block_ids
    while sched.running or sched.waiting:
        run_step(sched)
    assert sched.pool.num_free_blocks == 16


def test_impossible_requests_rejected_at_submit():
    sched = Scheduler(config(), num_blocks=4, max_model_len=100)
    with pytest.raises(RequestError, match="beyond the context limit of 100"):
        sched.add(make_request("long", 90, 20))
    with pytest.raises(RequestError, match="pool holds 4"):
        sched.add(make_request("huge", 30, 10))
    with pytest.raises(RequestError, match="empty"):
        sched.add(make_request("empty", 0, 10))


def test_block_pool_check_and_act():
    pool = BlockPool(4, 16)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    ids = pool.allocate(3)
    pool.check_integrity([ids])
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(ids)
    pool.check_integrity([])
    with pytest.raises(RuntimeError):
        pool.free(ids)
    with pytest.raises(AssertionError):
        pool.check_integrity([[0]])


@pytest.mark.parametrize("seed", range(20))
def test_blocks_ever_used_are_the_most_ever_held_at_once(seed):
    """The pool's pages are resident once written: blank blocks freed are handed out again
    before any never used (they went first in, first out, so a pool of 1,000 blocks was
    walked end to end by requests holding a few blocks each)."""
    rng = random.Random(seed)
    pool = BlockPool(1000, 16)
    held: list[list[int]] = []
    most = 0
    for _ in range(400):
        if held and (rng.random() < 0.5 or not pool.can_allocate(8)):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(pool.allocate(rng.randint(1, 8)))
        in_use = sum(map(len, held))
        most = max(most, in_use)
        assert pool.num_used_blocks == in_use
        assert pool.num_touched_blocks == most
        assert {b for ids in held for b in ids} <= set(range(most))
    pool.check_integrity(held)


def test_cached_blocks_stay_while_never_used_ones_remain():
    pool = BlockPool(6, 2, caching=True)
    first = pool.allocate(2)
    for i, b in enumerate(first):
        pool.register(b, None if i == 0 else pool.key_of(first[0]), [i, i])
    pool.free(first)  # both keyed: kept for a later request with the same prefix
    blank = pool.allocate(1)
    pool.free(blank)  # no key: handed out again first
    assert pool.allocate(1) == blank and pool.num_touched_blocks == 3
    assert pool.allocate(3) == [3, 4, 5] and pool.num_evictions == 0
    assert pool.allocate(1) == [first[1]] and pool.num_evictions == 1  # the tail goes first
    pool.check_integrity([blank, [3, 4, 5], [first[1]]])
