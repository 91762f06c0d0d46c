"""The engine thread: one thread takes submissions and cancels from an inbox, steps the
scheduler and the SeqEngine, streams the outputs and publishes a stats snapshot.

EngineLoop is the thread's half of the engine; Engine (engine.py) adds the front door that
checks and builds a request before it goes into the inbox. Only the engine thread touches
the scheduler, the SeqEngine and the output streams; other threads append to the inbox."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Self

from lucedesk.engine.handle import RequestHandle, TokenLogprob
from lucedesk.engine.models.tokenizer import Tokenizer
from lucedesk.engine.output import OutputProcessor
from lucedesk.engine.plan import StepPlan
from lucedesk.engine.request import FinishReason, Request
from lucedesk.engine.scheduler import Scheduler
from lucedesk.engine.seq_engine import SeqEngine, StepResult
from lucedesk.engine.stats import EngineStats, StatsCollector

if TYPE_CHECKING:
    from lucedesk.engine.disk_cache import DiskPrefixCache, LoadedPrefix

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self, seq_engine: SeqEngine, scheduler: Scheduler, tokenizer: Tokenizer, model_name: str
    ) -> None:
        self.seq_engine = seq_engine
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.pool_basis = ""  # why the KV pool holds its blocks (said in the stats)
        # What one KV block holds, every layer's K and V (0 for a model with no KV tensors)
        self.kv_block_bytes: int = getattr(seq_engine, "block_bytes", 0)
        self.outputs = OutputProcessor(tokenizer, scheduler.finish)
        # ("add", (request, handle)) or ("cancel", request_id), appended by any thread
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._num_pending = 0  # submitted, not yet seen by the engine thread
        self._collector = StatsCollector()
        self._stats = EngineStats(model=model_name)
        self._thread: threading.Thread | None = None
        self._last_active = time.monotonic()  # a submission or a step, the latest
        self._stopping = False
        self._drain = False
        self._drain_timeout = 30.0
        self._closing: dict[str, None] = {}  # finished requests whose last delta waits
        # The prefix cache on disk (disk_cache.py), where one is kept: requests whose prompt
        # it holds more of than the pool wait for the read before they queue ("loaded").
        self.disk: DiskPrefixCache | None = None
        self._reading: dict[str, Request] = {}  # waiting for the disk, by id
        self._publish()  # monitors see the idle slots and the pool before any request

    # -- any thread -------------------------------------------------------------------------

    def start(self) -> Self:
        """Step the engine on a new thread (see build.launch_engine for the usual way)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.run_forever, name="lucedesk-engine", daemon=True
            )
            self._thread.start()
        return self

    def adopt_thread(self, thread: threading.Thread) -> None:
        """Record the thread that calls run_forever(), so shutdown() can wait for it."""
        self._thread = thread

    @property
    def num_queued(self) -> int:
        """Requests waiting for a slot, those not yet taken from the inbox included."""
        return self._num_pending + len(self.scheduler.waiting)

    def enqueue(self, req: Request, handle: RequestHandle) -> None:
        """Hand a checked request to the engine thread, which streams into `handle`."""
        self._num_pending += 1
        self._last_active = time.monotonic()
        self._inbox.append(("add", (req, handle)))
        self._wake.set()

    def quiet_for(self) -> float:
        """Seconds since the engine last had work; 0 while it has some (submitted, waiting,
        running, or its prefix read from disk). For chores that must not hold up requests."""
        if self._num_pending or self._has_work():
            return 0.0
        return time.monotonic() - self._last_active

    def cancel(self, request_id: str) -> None:
        self._inbox.append(("cancel", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    def say_pool_basis(self, basis: str) -> None:
        """Why the KV pool holds what it holds (catalog.fit.pool_basis), in every stats
        snapshot from now on."""
        self.pool_basis = basis
        self._stats = dataclasses.replace(self._stats, pool_basis=basis)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, drain: bool = False, timeout: float = 30.0) -> None:
        """Stop the engine thread. Every open request ends: with `drain`, by finishing (up to
        `timeout` seconds, then cancelled); otherwise cancelled at once."""
        self._drain = drain
        self._drain_timeout = timeout
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout + 5.0)
            self._thread = None
        if self.disk is not None:
            self.disk.close()  # the writes queued are finished first

    # -- engine thread ----------------------------------------------------------------------

    def run_forever(self) -> None:
        """The engine thread's loop, until shutdown()."""
        deadline = None
        while True:
            took = self._take_inbox()
            if self._stopping:
                deadline = deadline or time.monotonic() + self._drain_timeout
                if not self._drain or time.monotonic() > deadline or not self._has_work():
                    self._cancel_all()
                    self._publish()
                    return
            queued = self.scheduler.running or self.scheduler.waiting
            if not queued and not self.scheduler.recently_finished:  # (reads wake it)
                if took:
                    self._publish()  # requests waiting for the disk show as queued
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # a bug in the policy must not kill the thread
                log.exception("engine step failed; failing the running requests")
                for req in list(self.scheduler.running):
                    self._finish(req, FinishReason.ERROR, "internal engine error")
                self._publish()

    def step(self) -> None:
        """One scheduling step: take submissions and cancels, plan, execute, record, stream.
        The engine thread calls it in a loop; tests may call it directly instead."""
        started = self._last_active = time.monotonic()
        self._take_inbox()
        plan = self.scheduler.plan()
        if plan.finished_ids:  # even when nothing runs next: no state outlives its request
            self.seq_engine.forget(plan.finished_ids)
        for rid in plan.finished_ids:
            self._close(rid)  # cancelled at the step boundary
        if plan.loads and not self._load_blocks(plan):
            self._publish(0, started)
            return
        if not plan:
            self._publish(0, started)
            return
        ran = time.monotonic()
        result = self._execute(plan)
        now = time.monotonic()
        self.scheduler.observe(plan, now - ran)
        for row in plan.rows:
            row.request.progress_time = now
        if self.disk is not None:
            self._save_prompts(plan, result.errors)
        for slot, message in result.errors.items():
            req = next(r.request for r in plan.rows if r.request.slot == slot)
            self.scheduler.finish(req, FinishReason.ERROR, message)
        logprobs = {
            row.request.request_id: result.logprobs[row.request.slot]
            for row in plan.rows
            if row.request.slot in result.logprobs
        }
        produced = self.scheduler.update(plan, result.sampled, result.stopped, result.accepted)
        for req in self.outputs.process(produced, logprobs):
            self._collector.on_token(req, now)
        for rid in self.scheduler.recently_finished:
            self._close(rid)
        self._publish(len(produced), started)

    def _has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._reading)

    def _take_inbox(self) -> bool:
        """Whether there was anything to take."""
        took = bool(self._inbox)
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                req, handle = payload
                self.outputs.add(req, handle)
                req.arrival_step = self.scheduler.step  # came now, whatever the disk's read takes
                if not self._read_from_disk(req):
                    self._num_pending -= 1
                    self.scheduler.add(req)
            elif kind == "loaded":
                if self._reading.pop(payload.request_id, None) is not None:
                    self._num_pending -= 1
                    self.scheduler.add(payload)
            else:
                req = self.outputs.get(payload)
                if req is not None and not req.finished:
                    req.cancel_requested = True
        return took

    def _read_from_disk(self, req: Request) -> bool:
        """Whether the disk holds enough more of the request's prompt than the pool that
        it waits for the read (it comes back through the inbox as "loaded")."""
        from lucedesk.engine.disk_cache import MIN_BLOCKS

        disk = self.disk
        if disk is None or req.disk_digests is not None or req.num_prompt_tokens < disk.min_tokens:
            return False
        digests = req.disk_digests = disk.digests(req.prompt_ids)
        in_pool = len(self.scheduler.pool.lookup(req.prompt_ids)[0])
        # Until the folder has been read, the reading thread answers once it has.
        if disk.ready and disk.known(digests) - in_pool < MIN_BLOCKS:
            return False

        def loaded(prefix: LoadedPrefix | None) -> None:  # on the reading thread
            req.disk_prefix = prefix
            self._inbox.append(("loaded", req))
            self._wake.set()

        self._reading[req.request_id] = req
        disk.load(digests, in_pool, loaded)
        return True

    def _load_blocks(self, plan: StepPlan) -> bool:
        """Copy the blocks read from disk into the pool before the step reads them. If that
        fails, the blocks' keys are forgotten (no later request adopts what they do not
        hold), every request holding one ends with an error, and the step is not run."""
        try:
            for load in plan.loads:
                for at, tensors in load.prefix.pieces(load.start, len(load.block_ids)):
                    ids = load.block_ids[at : at + tensors[0].shape[1]]
                    self.seq_engine.write_blocks(ids, tensors)
            return True
        except Exception as exc:
            log.exception("loading blocks read from disk failed")
            bad = {b for load in plan.loads for b in load.block_ids}
            for req in [r for r in self.scheduler.running if bad.intersection(r.block_ids)]:
                self._finish(req, FinishReason.ERROR, f"loading cached blocks failed: {exc}")
            self.scheduler.pool.forget_keys(bad)
            return False

    def _save_prompts(self, plan: StepPlan, errors: dict[int, str]) -> None:
        """Copy to disk the blocks of each prompt computed in this step whose prompt is
        long enough and whose blocks the disk does not hold yet (before update() may end
        the request and give its blocks back)."""
        from lucedesk.engine.disk_cache import MIN_BLOCKS

        disk = self.disk
        bs = disk.block_size
        if not disk.ready:
            return  # what the folder holds is not known yet
        for row in plan.prefills:
            req = row.request
            if not row.sample or req.slot in errors or req.num_prompt_tokens < disk.min_tokens:
                continue
            if row.start + row.num_tokens != req.num_prompt_tokens:
                continue  # a preempted request computing its output again
            digests = req.disk_digests or disk.digests(req.prompt_ids)  # (computed on arrival)
            first = disk.known(digests, pending=True)
            if len(digests) - first < MIN_BLOCKS or not disk.has_room(len(digests) - first):
                continue
            tensors = self.seq_engine.read_blocks(req.block_ids[first : len(digests)])
            tokens = req.prompt_ids[first * bs : len(digests) * bs]
            disk.save(digests, first, tokens, tensors)

    def _execute(self, plan: StepPlan) -> StepResult:
        try:
            return self.seq_engine.execute(plan)
        except Exception as exc:
            if len(plan.rows) == 1:
                log.exception("step failed for %s", plan.rows[0].request.request_id)
                return StepResult({}, {plan.rows[0].request.slot: f"{type(exc).__name__}: {exc}"})
        # The batch failed: run each row alone to find the culprit. Re-writing the same KV
        # rows is harmless, and sampler state only advances on rows that succeed.
        sampled: dict[int, int] = {}
        errors: dict[int, str] = {}
        logprobs: dict[int, TokenLogprob] = {}
        stopped: set[int] = set()
        accepted: dict[int, tuple[int, ...]] = {}
        for row in plan.rows:
            alone = StepPlan(plan.step)
            (alone.decodes if row in plan.decodes else alone.prefills).append(row)
            try:
                r = self.seq_engine.execute(alone)
                sampled.update(r.sampled)
                errors.update(r.errors)
                logprobs.update(r.logprobs)
                stopped.update(r.stopped)
                accepted.update(r.accepted)
            except Exception as exc:
                log.exception("step failed for %s", row.request.request_id)
                errors[row.request.slot] = f"{type(exc).__name__}: {exc}"
        return StepResult(sampled, errors, logprobs, frozenset(stopped), accepted)

    def _close(self, request_id: str) -> None:
        """Count a finished request in the stats and queue its last delta, which the next
        snapshot sends (_publish): a client whose stream has ended reads stats in which the
        request no longer runs."""
        req = self.outputs.get(request_id)
        if req is not None and request_id not in self._closing:
            self._collector.on_finish(req)
            self._closing[request_id] = None

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(req, reason, error)
        self._close(req.request_id)

    def _cancel_all(self) -> None:
        self._take_inbox()
        reading, self._reading = list(self._reading.values()), {}
        self._num_pending -= len(reading)  # (their read's answer is dropped)
        for req in list(self.scheduler.running) + list(self.scheduler.waiting) + reading:
            self._finish(req, FinishReason.CANCELLED)
        self.scheduler.recently_finished.clear()

    def _publish(self, num_generated: int = 0, started: float | None = None) -> None:
        """A new stats snapshot after a step that began at `started` (rates count it)."""
        now = time.monotonic()
        self._collector.on_step(now if started is None else started, now, num_generated)
        self._stats = self._collector.snapshot(
            self.scheduler,
            self.model_name,
            now,
            self._num_pending,
            self.pool_basis,
            self.kv_block_bytes,
        )
        closing, self._closing = self._closing, {}
        for request_id in closing:
            self.outputs.close(request_id)
