"""Driving an engine step by step, for tests that need control over arrival times."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from lucedesk.config import EngineConfig
from lucedesk.engine.build import assemble
from lucedesk.engine.engine import Engine
from lucedesk.engine.handle import Completion
from lucedesk.engine.models.loader import LoadedModel
from lucedesk.engine.request import SamplingParams


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0


def make_engine(loaded: LoadedModel, **config) -> Engine:
    return assemble(loaded, EngineConfig(**config), torch.device("cpu")).engine


def random_jobs(
    loaded: LoadedModel,
    num: int,
    seed: int,
    prompt_range: tuple[int, int] = (1, 300),
    output_range: tuple[int, int] = (1, 64),
    sampled: bool = False,
    pressure: bool = True,
) -> list[Job]:
    rng = random.Random(seed)
    specials = loaded.tokenizer.special_ids
    vocab = [t for t in range(loaded.config.vocab_size) if t not in specials]
    jobs = []
    for i in range(num):
        prompt = [rng.choice(vocab) for _ in range(rng.randint(*prompt_range))]
        if sampled:
            params = SamplingParams(
                max_tokens=rng.randint(*output_range),
                temperature=0.9,
                top_p=0.95,
                top_k=50,
                seed=1000 + i,
                ignore_eos=True,
            )
        else:
            params = SamplingParams(
                max_tokens=rng.randint(*output_range), temperature=0.0, ignore_eos=True
            )
        jobs.append(Job(prompt, params, arrival_step=rng.randint(0, 40)))
    # Three requests first in line whose prompts fit together but whose outputs do not:
    # with a pool sized for the largest request (<= 23 blocks of 16), growing to 9 blocks
    # each forces the scheduler to preempt.
    for _ in range(3 if pressure else 0):
        prompt = [rng.choice(vocab) for _ in range(80)]
        jobs.insert(0, Job(prompt, replace(jobs[-1].params, max_tokens=64), arrival_step=0))
    return jobs


def run_jobs(engine: Engine, jobs: list[Job], check: bool = True) -> list[list[int]]:
    """Submit each job at its arrival step and step the engine until all are done, checking
    the block accounting after every step. Returns each job's output token ids."""
    return [c.token_ids for c in run_jobs_whole(engine, jobs, check)]


def run_jobs_whole(engine: Engine, jobs: list[Job], check: bool = True) -> list[Completion]:
    """run_jobs, returning each job's whole completion (logprobs included)."""
    handles: dict[int, object] = {}
    step = 0
    while len(handles) < len(jobs) or not all(h.finished for h in handles.values()):
        for i, job in enumerate(jobs):
            if i not in handles and job.arrival_step <= step:
                handles[i] = engine.submit(job.prompt, job.params, owner=f"job{i}")
        engine.step()
        if check:
            engine.scheduler.check_integrity()
        step += 1
        assert step < 50_000
    return [handles[i].result(timeout=0) for i in range(len(jobs))]


def run_alone(
    loaded: LoadedModel,
    jobs: list[Job],
    kernels: str = "torch",
    weights: str = "dtype",
    **config,
) -> list[list[int]]:
    """Each job by itself: one slot, whole prompt in one chunk, no preemption possible."""
    out = []
    for job in jobs:
        engine = make_engine(
            loaded,
            kernels=kernels,
            weights=weights,
            max_slots=1,
            kv_pool_tokens=4096,
            max_num_batched_tokens=512,
            prefill_chunk_idle=512,
            **config,
        )
        out.extend(run_jobs(engine, [Job(job.prompt, job.params, 0)], check=False))
    return out


def script_replies(engine: Engine, reply_for) -> None:
    """A scripted model on the real engine: every request's reply is the tokens of
    `reply_for(prompt_ids)` (text; special tokens written as their text are those tokens),
    then the model's first end token. The model still runs each step (KV, slots, stats);
    only the token a row samples is replaced, and a grammar's own end is ignored (the
    script's tokens end the reply). Requests without drafts."""
    execute = engine.seq_engine.execute
    tokenizer = engine.tokenizer
    replies: dict[str, list[int]] = {}

    def scripted(plan):
        result = execute(plan)
        for row in plan.rows:
            if not row.sample:
                continue
            req = row.request
            if req.request_id not in replies:
                text = reply_for(req.prompt_ids)
                replies[req.request_id] = tokenizer.encode(text, add_special_tokens=False) + [
                    tokenizer.stop_token_ids[0]
                ]
            ids = replies[req.request_id]
            result.sampled[req.slot] = ids[min(req.num_output_tokens, len(ids) - 1)]
        return result._replace(stopped=frozenset())

    engine.seq_engine.execute = scripted
