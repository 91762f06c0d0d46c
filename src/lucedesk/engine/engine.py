"""The engine as clients hold it: Engine checks and builds a request before the engine thread
(engine_loop.py) takes it, compiles grammars and answers what room a prompt leaves; clients
submit token ids, cancel and read handles. It knows tokens, never chat messages: the chat
layer (lucedesk.chat) turns a chat into tokens and a grammar."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from lucedesk.engine.engine_loop import EngineLoop
from lucedesk.engine.grammar import Grammar, GrammarCompiler
from lucedesk.engine.handle import RequestHandle
from lucedesk.engine.models.tokenizer import Tokenizer
from lucedesk.engine.request import Request, SamplingParams
from lucedesk.engine.scheduler import Scheduler
from lucedesk.engine.seq_engine import SeqEngine
from lucedesk.engine.speculation import PromptLookup
from lucedesk.errors import ContextOverflow, RequestError

# How long the engine has had no work before the vocabulary warm-up begins (Engine.warm_up).
WARM_UP_QUIET_S = 1.0


class QueueFullError(RequestError):
    """The waiting queue is at its limit; try again shortly."""


class EngineNotReady(QueueFullError):
    """No engine serves yet (starting, or loading another model): try again shortly. Its
    message says what is under way."""


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What clients are told about the loaded model: built once, where an engine is put
    around the loaded model (build.assemble), its context length the one the engine uses."""

    name: str
    path: str = ""
    architecture: str = ""
    quantization: str = ""
    context_length: int = 0


class Engine(EngineLoop):
    """The engine as clients see it: the engine loop (its thread, submit's inbox, cancel,
    stats, shutdown) behind the checks a request passes before it is queued."""

    def __init__(
        self,
        seq_engine: SeqEngine,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        model_info: ModelInfo,
        max_waiting: int = 256,
    ) -> None:
        super().__init__(seq_engine, scheduler, tokenizer, model_info.name)
        self.model_info = model_info
        self.max_waiting = max_waiting
        self.max_model_len = scheduler.max_model_len
        self.grammars = GrammarCompiler(
            tokenizer, getattr(seq_engine, "vocab_size", tokenizer.vocab_size)
        )
        self._ids = itertools.count()
        self._warming: threading.Thread | None = None

    def warm_up(self, quiet: float = WARM_UP_QUIET_S) -> None:
        """Builds llguidance's view of the vocabulary on a thread of its own (~0.2 s for 49k
        tokens, more for larger ones) once the engine has had no work for `quiet` seconds,
        so the first request with a grammar or logprobs does not wait for it. Not at once:
        the build holds the interpreter lock throughout, and begun at ready it held up the
        first request as long (a short completion right after ready: 0.23 -> 0.06 s)."""
        self._last_active = time.monotonic()  # quiet from now at the earliest

        def build() -> None:
            while not self._stopping:
                if self.quiet_for() >= quiet:
                    _ = self.grammars.ll_tokenizer  # built once, kept
                    return
                time.sleep(0.05)

        self._warming = threading.Thread(target=build, name="lucedesk-grammar-warm-up", daemon=True)
        self._warming.start()

    def shutdown(self, drain: bool = False, timeout: float = 30.0) -> None:
        """The engine thread stopped (engine_loop), and the warm-up finished: a process
        that exits while llguidance builds its vocabulary in native code can crash."""
        super().shutdown(drain, timeout)
        if self._warming is not None:
            self._warming.join(30.0)

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
        if self.num_queued >= self.max_waiting:
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
        self.enqueue(req, handle)
        return handle

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
