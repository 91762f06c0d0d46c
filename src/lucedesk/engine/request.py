"""A request's sampling settings and its state as the scheduler sees it (no torch here)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lucedesk.engine.grammar import Grammar
from lucedesk.engine.speculation import PromptLookup
from lucedesk.errors import RequestError

if TYPE_CHECKING:
    from lucedesk.engine.disk_cache import LoadedPrefix

MAX_TOP_LOGPROBS = 20


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"
    ERROR = "error"


class Phase(enum.StrEnum):
    WAITING = "waiting"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from prompt + output
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None  # the output must match it (constrained decoding)
    logprobs: int | None = None  # None: off; N: each token's logprob and the N most likely
    # Prompt-lookup drafts (speculation.py): None = the engine's default. Requests without
    # logprobs take them; the tokens are the same either way.
    speculative: bool | None = None

    @property
    def greedy(self) -> bool:
        # Below this the distribution is a point mass anyway (and dividing by it overflows).
        return self.temperature < 1e-5

    def validate(self) -> SamplingParams:
        """Raises RequestError naming the first invalid field; returns self."""

        def bad(name: str, rule: str) -> RequestError:
            got = repr(getattr(self, name))  # a long value is shown by its start
            got = got if len(got) <= 60 else got[:57] + "..."
            return RequestError(f"{name} {rule} (got {got})", name)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise bad("max_tokens", "must be an integer")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        for name, low, high in (
            ("temperature", 0.0, 100.0),
            ("top_p", 0.0, 1.0),
            ("min_p", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise bad(name, "must be a number")
            if not math.isfinite(value) or not low <= value <= high:
                raise bad(name, f"must be between {low:g} and {high:g}")
        if self.top_p == 0.0:
            raise bad("top_p", "must be greater than 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 turn it off)")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise bad("seed", "must be an integer")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "must fit in 64 bits")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", "may hold at most 16 strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise bad("speculative", "must be true, false or null")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        return self


@dataclass(slots=True, eq=False)
class Request:
    """State of one generation. Its tokens are prompt + output; `num_computed_tokens` counts
    those whose KV is in the cache, so the phase follows from the counts:

        prompt = [p0 .. p9], output = [o0 o1]        num_tokens = 12
        num_computed_tokens = 11  -> DECODE  (o1 is the next input)
        num_computed_tokens = 4   -> PREFILL (tokens 4..11 still to compute)
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    owner: str = ""
    interactive: bool = False  # someone watches it: the scheduler keeps its pace first
    stop_ids: frozenset[int] = frozenset()  # model's end tokens (unless ignore_eos) + params'
    # The llguidance matcher of `params.grammar` (engine/grammar.py); it has consumed every
    # output token, so preemption and prefix adoption (which touch only KV) leave it valid.
    matcher: object | None = None
    end_ids: frozenset[int] = frozenset()  # the model's end tokens (a grammar may allow them)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)  # this request's block table
    block_keys: list[int] = field(default_factory=list)  # prefix keys of its computed blocks
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    scheduled_step: int = 0  # the scheduler step that last ran a row of it (or admitted it)
    arrival_step: int | None = None  # the scheduler's last step when it came (engine or queue)
    first_token_step: int | None = None  # the step that gave it its first output token
    progress_time: float | None = None  # when a step last ran a row of it (monotonic)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held at admission
    # Blocks of its prompt read from the prefix cache on disk (disk_cache.LoadedPrefix),
    # until admission takes them; and its prompt's block digests, once the disk was asked.
    disk_prefix: LoadedPrefix | None = None
    disk_digests: list[bytes] | None = None
    # Prompt lookup, where on for this request: its index, the next draft's length and what
    # its drafts came to.
    lookup: PromptLookup | None = None
    draft_limit: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    cancel_requested: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def phase(self) -> Phase:
        if self.finish_reason is not None:
            return Phase.FINISHED
        if self.slot is None:
            return Phase.PREEMPTED if self.num_preemptions else Phase.WAITING
        if self.output_ids and self.num_computed_tokens == self.num_tokens - 1:
            return Phase.DECODE
        return Phase.PREFILL

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]
