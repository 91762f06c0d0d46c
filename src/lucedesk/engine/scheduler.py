"""The scheduling policy: who runs in the next step, with which tokens (no torch, no I/O).

Each step:
  1. cancellations take effect (slot and blocks back);
  2. every decoding request gets one token, oldest first; one that needs a new block when
     none is free preempts the most recently admitted request (possibly itself); a request
     with prompt lookup on may add a draft of the tokens likely to follow (speculation.py),
     where blocks and budget are free without preempting anyone;
  3. the rest of the token budget, capped by the prefill chunk (large while nothing decodes;
     while something does, fixed and small, or paced from timed steps so that the decodes
     keep their time per token: pacing.py), goes to prompt chunks, oldest first. Pacing
     is for watched streams and for those that were streaming before a prompt in line
     came: prompts that all came with the streams (a burst of requests, subagents started
     together) run at the fixed chunk, so that each reaches its first token sooner;
  4. the head of the waiting queue is admitted while a slot and the blocks for its tokens
     plus headroom are free, strictly in order: a request that does not fit blocks the ones
     behind it; it runs a first chunk where the budget has room left.

No running request goes `background_every` steps without a row: one that has waited that
long decodes, or runs at least a block of its prompt, whatever the watched stream, the
budget or the older prompts ask.
"""

from __future__ import annotations

import itertools
from collections import deque

from lucedesk.config import EngineConfig
from lucedesk.engine.kv_cache import BlockPool, blocks_for, chain_key
from lucedesk.engine.pacing import StepPacer
from lucedesk.engine.plan import BlockLoad, ScheduledRow, StepPlan
from lucedesk.engine.request import FinishReason, Phase, Request
from lucedesk.errors import RequestError


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, config.block_size, caching=config.prefix_cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order, oldest first
        self.free_slots = list(range(config.max_slots))
        self.step = 0
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0  # tokens looked up in the prefix cache at admission
        self.num_prefix_hit_tokens = 0  # ...of which the cache already held the KV
        self.num_disk_hit_tokens = 0  # ...of which was read from disk (disk_cache.py)
        self.num_computed_prompt_tokens = 0  # tokens run through prefill chunks
        self.num_draft_rows = 0  # decode rows that carried a draft
        self.num_draft_tokens = 0  # draft tokens run through the model
        self.num_accepted_tokens = 0  # ...of which the model agreed with
        self.recently_finished: list[str] = []  # finished since the last plan
        self.pacer = (
            StepPacer(
                config.decode_slowdown,
                min(config.block_size, config.prefill_chunk_idle),
                config.prefill_chunk_idle,
                config.decode_step_ms / 1000,
            )
            if config.decode_slowdown
            else None
        )

    # -- submission -------------------------------------------------------------------------

    def check_fits(self, request: Request) -> None:
        """Raises RequestError if the request could never run, whatever else is queued."""
        n = request.num_prompt_tokens
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        total = n + request.params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) plus max_tokens ({request.params.max_tokens}) is "
                f"{total} tokens, beyond the context limit of {self.max_model_len}",
                "max_tokens",
            )
        needed = blocks_for(total, self.config.block_size)
        if needed > self.pool.num_blocks:
            raise RequestError(
                f"the request needs {needed} KV blocks at full length but the pool holds "
                f"{self.pool.num_blocks}",
                "max_tokens",
            )

    def add(self, request: Request) -> None:
        self.check_fits(request)
        if request.arrival_step is None:  # (the engine stamps it before a disk read)
            request.arrival_step = self.step
        self.waiting.append(request)

    # -- one step ---------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        self.step += 1
        plan = StepPlan(self.step)
        for req in [r for r in self.running if r.cancel_requested]:
            self.finish(req, FinishReason.CANCELLED)
        for req in [r for r in self.waiting if r.cancel_requested]:
            self.finish(req, FinishReason.CANCELLED)

        # While an interactive request decodes, the others join every background_every-th
        # step: the watched stream's steps stay short, and each background one still moves.
        watched = any(r.interactive and r.phase is Phase.DECODE for r in self.running)
        everyone = not watched or self.step % self.config.background_every == 0
        for req in list(self.running):
            if req.slot is None or req.phase is not Phase.DECODE:
                continue  # preempted earlier in this loop, or still prefilling
            if not (everyone or req.interactive or self._overdue(req)):
                continue
            if self._reserve_next_block(req):
                plan.decodes.append(ScheduledRow(req, req.num_computed_tokens, 1, True))
        self._add_drafts(plan, watched)

        prompts = [r for r in self.running if r.phase is Phase.PREFILL]
        budget = min(
            self.config.max_num_batched_tokens - plan.num_tokens, self._chunk(plan, prompts)
        )
        # A prompt that has waited background_every steps runs a block at least, first (the
        # step's budget keeps a block for each of the others).
        overdue = [r for r in prompts if self._overdue(r)]
        bs = self.config.block_size
        for i, req in enumerate(overdue):
            room = self.config.max_num_batched_tokens - plan.num_tokens
            room -= bs * (len(overdue) - 1 - i)
            budget -= self._schedule_chunk(plan, req, min(room, max(budget, bs)))
        for req in prompts:
            if budget <= 0:
                break
            if (everyone or req.interactive) and not self._overdue(req):
                budget -= self._schedule_chunk(plan, req, budget)

        # Admitted even when the budget is spent: a running request has the guarantee above.
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if not (everyone or req.interactive):
                break  # strict FIFO: the head waits for a background step, and so do those behind
            if not self._admit(req, plan):
                break  # strict FIFO: nothing overtakes the head
            self.waiting.popleft()
            budget -= self._schedule_chunk(plan, req, budget)

        for row in plan.rows:
            row.request.scheduled_step = self.step
        plan.finished_ids, self.recently_finished = self.recently_finished, []
        return plan

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """The engine ran `plan` in `seconds`: what paced chunks are sized from."""
        if self.pacer is not None:
            prompt = sum(r.num_tokens for r in plan.prefills)
            self.pacer.observe(plan.num_tokens - prompt, prompt, seconds)

    def update(
        self,
        plan: StepPlan,
        sampled: dict[int, int],
        stopped: frozenset[int] = frozenset(),
        accepted: dict[int, tuple[int, ...]] | None = None,
    ) -> list[Request]:
        """Record a step's result: `sampled` maps slot -> new token for each sampling row
        (a row missing from it failed and was finished with an error); `stopped` holds the
        slots whose grammar is complete with that token; `accepted` maps a draft row's slot
        to the draft tokens the model agreed with, which come before its `sampled` token
        (the model's own after them). Returns the requests that produced a token, once per
        token, in order."""
        produced = []
        for row in plan.rows:
            req = row.request
            if req.finished or req.slot is None:
                continue
            token = sampled.get(req.slot) if row.sample else None
            kept = (accepted or {}).get(req.slot, ()) if token is not None else ()
            # A draft row's KV holds its input and the drafts the model agreed with; the
            # rest of the draft is written over by the next step.
            done = 1 + len(kept) if row.draft else row.num_tokens
            req.num_computed_tokens = row.start + done
            self._register_full_blocks(req)
            if row.draft:
                self.num_draft_rows += 1
                self.num_draft_tokens += len(row.draft)
                self.num_accepted_tokens += len(kept)
                req.num_draft_tokens += len(row.draft)
                req.num_accepted_tokens += len(kept)
                req.draft_limit = _next_draft_limit(
                    req.draft_limit, len(row.draft), len(kept), self.config.prompt_lookup_tokens
                )
            if token is None:
                continue
            new = (*kept, token)
            if req.first_token_step is None:
                req.first_token_step = plan.step
            for i, t in enumerate(new):
                req.output_ids.append(t)
                produced.append(req)
                if t in req.stop_ids or (i == len(new) - 1 and req.slot in stopped):
                    self.finish(req, FinishReason.STOP)
                elif (
                    req.num_output_tokens >= req.params.max_tokens
                    or req.num_tokens >= self.max_model_len
                ):
                    self.finish(req, FinishReason.LENGTH)
                if req.finished:
                    break
        return produced

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        req.error = error
        if req in self.running:
            self._release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.recently_finished.append(req.request_id)

    # -- helpers ----------------------------------------------------------------------------

    def _chunk(self, plan: StepPlan, prompts: list[Request]) -> int:
        """The most prompt tokens this step runs besides its decode rows (`prompts`: the
        running ones still prefilling)."""
        if not plan.decodes:
            return self.config.prefill_chunk_idle
        if self.pacer is None or not self._keeps_pace(plan, prompts):
            return self.config.prefill_chunk_decoding
        return self.pacer.chunk(plan.num_tokens)

    def _keeps_pace(self, plan: StepPlan, prompts: list[Request]) -> bool:
        """Whether a decode row of `plan` is watched (interactive), or was streaming before
        a prompt in line (`prompts` or waiting) came (a step before at least): the chunk is
        then paced for it."""
        in_line = itertools.chain(prompts, self.waiting)
        newest = max((r.arrival_step for r in in_line), default=None)
        return newest is not None and any(
            row.request.interactive
            or (row.request.first_token_step is not None and row.request.first_token_step < newest)
            for row in plan.decodes
        )

    def _overdue(self, req: Request) -> bool:
        return self.step - req.scheduled_step >= self.config.background_every

    def _add_drafts(self, plan: StepPlan, watched: bool) -> None:
        """Lengthen decode rows with prompt-lookup drafts, in order, while the step's token
        budget (less a prompt chunk, when one is waiting) and blank blocks allow: a draft
        never preempts anyone, evicts no cached prefix, and never runs past the request's
        max_tokens or the context. While an interactive request decodes, only interactive
        rows draft, so that the step the background joins stays light."""
        prompts_waiting = self.waiting or any(r.phase is Phase.PREFILL for r in self.running)
        spare = self.config.max_num_batched_tokens - len(plan.decodes)
        if prompts_waiting:
            spare -= self.config.prefill_chunk_decoding
        bs = self.config.block_size
        for i, row in enumerate(plan.decodes):
            req = row.request
            if req.lookup is None or spare <= 0 or (watched and not req.interactive):
                continue
            left = min(
                req.params.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1,
                req.draft_limit,
                spare,
            )
            draft = req.lookup.draft(req.token_ids(0, req.num_tokens), left)
            # Room for the draft's KV: the blocks it holds, and more only from free ones.
            need = blocks_for(row.start + 1 + len(draft), bs) - len(req.block_ids)
            if need > 0:
                req.block_ids.extend(self.pool.allocate(min(need, self.pool.num_blank_blocks)))
                draft = draft[: len(req.block_ids) * bs - row.start - 1]
            if draft:
                plan.decodes[i] = row._replace(num_tokens=1 + len(draft), draft=tuple(draft))
                spare -= len(draft)

    def _admit(self, req: Request, plan: StepPlan) -> bool:
        """Give the head a slot and the blocks for its tokens plus headroom, all at once.
        Cached blocks holding its prefix are adopted (shared) instead of computed again, and
        are not charged as new blocks; blocks read from disk beyond them (req.disk_prefix)
        are loaded into its new blocks before the step runs."""
        pool, bs = self.pool, self.config.block_size
        tokens = req.token_ids(0, req.num_tokens)
        hits, in_flight = pool.lookup(tokens)
        if in_flight:
            return False  # its next prefix block is being computed: take it when it lands
        headroom = min(self.config.decode_headroom_tokens, req.params.max_tokens)
        new = blocks_for(req.num_tokens + headroom, bs) - len(hits)
        if not pool.can_allocate(new + pool.num_free_among(hits)):
            return False
        pool.adopt(hits)
        req.block_ids = hits + pool.allocate(new)
        req.block_keys = [pool.key_of(b) for b in hits]
        loaded = 0
        prefix, req.disk_prefix = req.disk_prefix, None
        if prefix is not None and prefix.first <= len(hits) < prefix.end:
            loaded = prefix.end - len(hits)
            ids = req.block_ids[len(hits) : len(hits) + loaded]
            plan.loads.append(BlockLoad(ids, prefix, len(hits) - prefix.first))
            self.num_disk_hit_tokens += loaded * bs
        req.num_computed_tokens = (len(hits) + loaded) * bs
        if req.num_cached_tokens is None:  # the first admission; not a preempted return
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        req.slot = self.free_slots.pop(0)
        req.scheduled_step = self.step
        self.running.append(req)
        if pool.caching:
            self.num_prefix_query_tokens += req.num_tokens
            self.num_prefix_hit_tokens += (len(hits) + loaded) * bs
            self._register_full_blocks(req)  # the loaded blocks, for later requests
            self._expect_blocks(req, tokens)
        return True

    def _expect_blocks(self, req: Request, tokens: list[int]) -> None:
        """Announce the keys of the full blocks this request's prefill will compute."""
        bs = self.config.block_size
        keys, key = [], req.block_keys[-1] if req.block_keys else None
        first = len(req.block_keys)
        for i in range(first, (len(tokens) - 1) // bs):
            key = chain_key(key, tokens[i * bs : (i + 1) * bs])
            keys.append(key)
        self.pool.expect(req.block_ids[first : first + len(keys)], keys)

    def _register_full_blocks(self, req: Request) -> None:
        """Key every block whose tokens are now all computed, so later requests can share it."""
        if not self.pool.caching:
            return
        bs = self.config.block_size
        while len(req.block_keys) < req.num_computed_tokens // bs:
            i = len(req.block_keys)
            previous = req.block_keys[-1] if req.block_keys else None
            key = self.pool.register(
                req.block_ids[i], previous, req.token_ids(i * bs, (i + 1) * bs)
            )
            req.block_keys.append(key)

    def _schedule_chunk(self, plan: StepPlan, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if n <= 0:
            return 0
        self.num_computed_prompt_tokens += n
        done = req.num_computed_tokens + n == req.num_tokens
        plan.prefills.append(ScheduledRow(req, req.num_computed_tokens, n, done))
        return n

    def _reserve_next_block(self, req: Request) -> bool:
        """Make room for the KV of position num_computed_tokens, preempting the newest
        running requests while the pool is empty. False if `req` itself was preempted."""
        while len(req.block_ids) * self.config.block_size <= req.num_computed_tokens:
            if self.pool.can_allocate(1):
                req.block_ids.extend(self.pool.allocate(1))
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        # Its KV is dropped and recomputed later from prompt + output; the output so far stays.
        self._release(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.pool.unexpect(req.block_ids)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.block_keys = []
        if req.slot is not None:
            self.free_slots.append(req.slot)
            self.free_slots.sort()
            req.slot = None

    def check_integrity(self) -> None:
        self.pool.check_integrity(r.block_ids for r in self.running)
        slots = [r.slot for r in self.running]
        assert None not in slots, "a running request has no slot"
        assert len(set(slots) | set(self.free_slots)) == self.config.max_slots
        assert not set(slots) & set(self.free_slots), "a slot is both used and free"
        assert all(not r.block_ids and r.slot is None for r in self.waiting)


def _next_draft_limit(limit: int, drafted: int, kept: int, most: int) -> int:
    """A request's next draft length: doubled (up to `most`) after a draft the model took
    whole, halved (down to 1) after one it took none of."""
    if kept == drafted:
        return min(most, limit * 2)
    if kept == 0:
        return max(1, limit // 2)
    return limit
