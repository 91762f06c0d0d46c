"""The engine: one thread steps the scheduler and the SeqEngine; everyone else submits,
cancels and reads handles."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lucedesk.engine.chat_encoder import ChatEncoder, ChatPrompt
from lucedesk.engine.grammar import Grammar, GrammarCompiler
from lucedesk.engine.handle import RequestHandle, RequestOutput, TokenLogprob
from lucedesk.engine.messages import ChatMessage, Tool, ToolChoice
from lucedesk.engine.models.tokenizer import IncrementalDetokenizer, Tokenizer
from lucedesk.engine.request import FinishReason, Request, SamplingParams
from lucedesk.engine.scheduler import Scheduler, StepPlan
from lucedesk.engine.seq_engine import SeqEngine, StepResult
from lucedesk.engine.speculation import PromptLookup
from lucedesk.engine.stats import EngineStats, StatsCollector
from lucedesk.engine.tool_parser import overlap_with_start
from lucedesk.errors import ContextOverflow, RequestError

log = logging.getLogger(__name__)


class QueueFullError(RequestError):
    """The waiting queue is at its limit; try again shortly."""


@dataclass(slots=True)
class _Stream:
    """Per-request output state kept by the engine thread."""

    handle: RequestHandle
    detokenizer: IncrementalDetokenizer
    text: str = ""  # all output text so far, stop strings included
    num_emitted: int = 0  # characters of `text` already sent
    num_tokens_sent: int = 0
    num_pushed: int = 0  # output tokens given to the detokenizer
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    stop_sequence: str | None = None  # the stop string that ended it


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What clients are told about the loaded model."""

    name: str
    path: str = ""
    architecture: str = ""
    quantization: str = ""
    context_length: int = 0


class Engine:
    def __init__(
        self,
        seq_engine: SeqEngine,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        model_name: str = "",
        max_waiting: int = 256,
    ) -> None:
        self.seq_engine = seq_engine
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_info = ModelInfo(model_name, context_length=scheduler.max_model_len)
        self.max_waiting = max_waiting
        self.max_model_len = scheduler.max_model_len
        self.grammars = GrammarCompiler(
            tokenizer, getattr(seq_engine, "vocab_size", tokenizer.vocab_size)
        )
        self.chat = ChatEncoder(tokenizer, self.grammars)
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._collector = StatsCollector()
        self._stats = EngineStats(model=model_name)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain = False
        self._drain_timeout = 30.0
        self._num_pending = 0  # submitted, not yet seen by the engine thread
        self._publish()  # monitors see the idle slots and the pool before any request

    # -- public API (any thread) ------------------------------------------------------------

    def start(self) -> Engine:
        """Step the engine on a new thread (see build.launch_engine for the usual way)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.run_forever, name="lucedesk-engine", daemon=True
            )
            self._thread.start()
        return self

    def warm_up(self) -> None:
        """Builds llguidance's view of the vocabulary on a thread of its own (~0.2 s for 49k
        tokens, more for larger ones), so the first request with a grammar or logprobs does
        not wait for it."""
        threading.Thread(
            target=lambda: self.grammars.ll_tokenizer, name="lucedesk-grammar-warm-up", daemon=True
        ).start()

    def adopt_thread(self, thread: threading.Thread) -> None:
        """Record the thread that calls run_forever(), so shutdown() can wait for it."""
        self._thread = thread

    def encode_chat(
        self,
        messages: Iterable[ChatMessage | Mapping],
        tools: list[Tool] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool = True,
        response_format: Grammar | None = None,
        reasoning: str | None = None,
        continue_final: bool = False,
    ) -> ChatPrompt:
        """The prompt for a chat and the grammar its reply must follow (chat_encoder.py);
        raises RequestError naming the bad field."""
        return self.chat.encode(
            messages,
            tools,
            tool_choice,
            parallel_tool_calls,
            response_format,
            reasoning,
            continue_final,
        )

    @property
    def reasoning_format(self) -> str | None:
        """How the loaded model reasons: "think", "harmony" or None."""
        return self.chat.reasoning_format

    def check_grammar(self, grammar: Grammar) -> None:
        """Raises RequestError (naming the grammar's field) if it cannot be compiled."""
        self.grammars.check(grammar)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (for logprobs: a token may hold part of a
        character)."""
        return self.grammars.token_bytes(token_id)

    def output_room(
        self, num_prompt_tokens: int, max_tokens: int | None, field: str = "messages"
    ) -> int:
        """The max_tokens to submit: `max_tokens` (an upper bound) capped to the room the
        prompt leaves in one request; all that room when None. Raises RequestError (naming
        `field`) when the prompt is empty, ContextOverflow when it leaves no room."""
        if num_prompt_tokens == 0:
            raise RequestError("the prompt is empty", field)
        room = self.max_request_tokens - num_prompt_tokens
        if room < 1:
            raise ContextOverflow(num_prompt_tokens, self.max_request_tokens, field)
        return room if max_tokens is None else min(max_tokens, room)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        owner: str = "",
        request_id: str | None = None,
        interactive: bool = False,
    ) -> RequestHandle:
        """Queue a request; raises RequestError at once if it could never run. An
        `interactive` one (someone watches it) decodes every step; the rest may wait a few
        while it does (EngineConfig.background_every)."""
        if self._stopping:
            raise RequestError("the engine is shutting down")
        params.validate()
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(
                f"prompt token id {bad!r} is outside the vocabulary (0..{vocab - 1})", "prompt"
            )
        if self._num_pending + len(self.scheduler.waiting) >= self.max_waiting:
            raise QueueFullError(f"the queue is full ({self.max_waiting} requests waiting)")
        rid = request_id or f"req-{next(self._ids)}"
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.stop_token_ids)
        req = Request(
            rid,
            list(prompt_ids),
            params,
            owner=owner,
            interactive=interactive,
            stop_ids=frozenset(stop_ids),
        )
        self.scheduler.check_fits(req)
        config = self.scheduler.config
        speculate = config.prompt_lookup if params.speculative is None else params.speculative
        if speculate and params.logprobs is None:
            req.lookup, req.draft_limit = PromptLookup(), config.prompt_lookup_tokens
        if params.grammar is not None:
            req.matcher = self.grammars.matcher(params.grammar)
            req.end_ids = frozenset(self.tokenizer.stop_token_ids)
        handle = RequestHandle(rid, len(prompt_ids), self.cancel)
        self._num_pending += 1
        self._inbox.append(("add", (req, handle)))
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> None:
        self._inbox.append(("cancel", request_id))
        self._wake.set()

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold: the context limit or the
        whole KV pool, whichever is smaller."""
        pool = self.scheduler.pool
        return min(self.max_model_len, pool.num_blocks * pool.block_size)

    @property
    def max_slots(self) -> int:
        """Requests that can run at once, each in its own slot."""
        return self.scheduler.config.max_slots

    def stats(self) -> EngineStats:
        return self._stats

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

    # -- engine thread ----------------------------------------------------------------------

    def run_forever(self) -> None:
        """The engine thread's loop, until shutdown()."""
        deadline = None
        while True:
            self._take_inbox()
            if self._stopping:
                deadline = deadline or time.monotonic() + self._drain_timeout
                if not self._drain or time.monotonic() > deadline or not self._has_work():
                    self._cancel_all()
                    self._publish()
                    return
            if not self._has_work() and not self.scheduler.recently_finished:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # a bug in the policy must not kill the thread
                log.exception("engine step failed; failing the running requests")
                for req in list(self.scheduler.running):
                    self._finish(req, FinishReason.ERROR, "internal engine error")

    def _has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def _take_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                req, handle = payload
                self._num_pending -= 1
                self._requests[req.request_id] = req
                self._streams[req.request_id] = _Stream(
                    handle, self.tokenizer.detokenizer(req.prompt_ids)
                )
                self.scheduler.add(req)
            else:
                req = self._requests.get(payload)
                if req is not None and not req.finished:
                    req.cancel_requested = True

    def step(self) -> None:
        """One scheduling step: take submissions and cancels, plan, execute, record, stream.
        The engine thread calls it in a loop; tests may call it directly instead."""
        started = time.monotonic()
        self._take_inbox()
        plan = self.scheduler.plan()
        if plan.finished_ids:  # even when nothing runs next: no state outlives its request
            self.seq_engine.forget(plan.finished_ids)
        for rid in plan.finished_ids:
            self._close(rid)  # cancelled at the step boundary
        if not plan:
            self._publish(0, started)
            return
        result = self._execute(plan)
        for slot, message in result.errors.items():
            req = next(r.request for r in plan.rows if r.request.slot == slot)
            self.scheduler.finish(req, FinishReason.ERROR, message)
        logprobs = {
            row.request.request_id: result.logprobs[row.request.slot]
            for row in plan.rows
            if row.request.slot in result.logprobs
        }
        produced = self.scheduler.update(plan, result.sampled, result.stopped, result.accepted)
        now = time.monotonic()
        for req in produced:
            s = self._streams.get(req.request_id)
            if s is None or s.num_pushed >= req.num_output_tokens:
                continue  # dropped: it came after a stop string in the same step
            self._collector.on_token(req, now)
            try:
                self._stream(req, logprobs.get(req.request_id))
            except Exception as exc:  # detokenizing one request must not stop the others
                log.exception("output processing failed for %s", req.request_id)
                self.scheduler.finish(req, FinishReason.ERROR, f"output processing failed: {exc}")
        for rid in self.scheduler.recently_finished:
            self._close(rid)
        self._publish(len(produced), started)

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

    def _stream(self, req: Request, logprob: TokenLogprob | None) -> None:
        """Detokenize the request's next output token and send what is safe to send. A draft
        row gives several tokens in one step: each comes here in turn, the last one `last`."""
        s = self._streams[req.request_id]
        token = req.output_ids[s.num_pushed]
        s.num_pushed += 1
        last = s.num_pushed == req.num_output_tokens
        if logprob is not None:
            s.logprobs.append(logprob)
        if token not in req.stop_ids:  # end tokens are counted, never shown
            s.text += s.detokenizer.push([token])
        stops = req.params.stop
        if stops and not (req.finished and last):
            # Look for a stop string in the newly decoded tail; never send one to the client.
            window = max(map(len, stops)) + 8
            tail_from = max(0, s.num_emitted - window)
            hits = [(i, st) for st in stops if (i := s.text.find(st, tail_from)) >= 0]
            if hits:
                at, s.stop_sequence = min(hits)
                s.text = s.text[:at]
                del req.output_ids[s.num_pushed :]  # drafted tokens after it are not output
                last = True
                if req.finished:  # at a later token of this step, which the stop cuts off
                    req.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(req, FinishReason.STOP)
        if req.finished and last:
            s.text += s.detokenizer.flush() if req.finish_reason is not FinishReason.STOP else ""
            return  # sent by _close
        # Hold back a tail that could still grow into a stop string.
        held = max((overlap_with_start(s.text, st) for st in stops), default=0)
        self._send(req, s, len(s.text) - held)

    def _send(self, req: Request, s: _Stream, upto: int, final: bool = False) -> None:
        text = s.text[s.num_emitted : upto]
        tokens = tuple(req.output_ids[s.num_tokens_sent :])
        logprobs = tuple(s.logprobs[s.num_tokens_sent :])
        if not text and not tokens and not final:
            return
        s.num_emitted = max(s.num_emitted, upto)
        s.num_tokens_sent = req.num_output_tokens
        s.handle.push(
            RequestOutput(
                request_id=req.request_id,
                text=text,
                token_ids=tokens,
                finished=final,
                finish_reason=req.finish_reason if final else None,
                error=req.error if final else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_cached_tokens=req.num_cached_tokens or 0,
                logprobs=logprobs,
                stop_sequence=s.stop_sequence if final else None,
            )
        )

    def _close(self, request_id: str) -> None:
        """Send a finished request's last delta and forget it."""
        s = self._streams.pop(request_id, None)
        req = self._requests.pop(request_id, None)
        if s is None or req is None:
            return
        self._collector.on_finish(req)
        self._send(req, s, len(s.text), final=True)

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(req, reason, error)
        self._close(req.request_id)

    def _cancel_all(self) -> None:
        self._take_inbox()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(req, FinishReason.CANCELLED)
        self.scheduler.recently_finished.clear()

    def _publish(self, num_generated: int = 0, started: float | None = None) -> None:
        """A new stats snapshot after a step that began at `started` (rates count it)."""
        sched, c = self.scheduler, self._collector
        now = time.monotonic()
        c.on_step(now if started is None else started, now, num_generated)
        by_slot = {r.slot: r for r in sched.running}
        pool = sched.pool
        self._stats = EngineStats(
            time=now,
            step=sched.step,
            model=self.model_name,
            slots=tuple(c.slot(i, by_slot.get(i), now) for i in range(sched.config.max_slots)),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + self._num_pending,
            blocks_used=pool.num_used_blocks,
            blocks_total=pool.num_blocks,
            block_size=pool.block_size,
            spans=c.spans(),
            num_preemptions=sched.num_preemptions,
            num_completed=c.num_completed,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            finish_reasons=dict(c.finish_reasons),
            ttft=c.ttft.snapshot(),
            itl=c.itl.snapshot(),
            prefix_cache_hit_tokens=sched.num_prefix_hit_tokens,
            prefix_cache_queries=sched.num_prefix_query_tokens,
            prefix_cached_blocks=pool.num_cached_blocks,
            draft_rows=sched.num_draft_rows,
            draft_tokens=sched.num_draft_tokens,
            accepted_tokens=sched.num_accepted_tokens,
        )
