"""One chat turn, protocol-neutral: the request in engine terms, submitted, and its reply as
a stream of events (text, tool-call pieces, the end) or as a whole. Every HTTP protocol
adapter translates its wire format into a `TurnRequest` and these events back into its own
shape; agents run their model turns through the same path.

    turn = submit_turn(engine, TurnRequest(messages, tools, ...), owner="http:curl")
    async for event in turn.events(): ...   # TextPiece | ReasoningPiece | CallDelta | TurnEnd
    result = await turn.complete(gone)           # the whole reply; cancels once gone() says so
    result = await turn.collect(on_text)         # the whole reply, its text seen as it comes
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from lucedesk.engine.grammar import Grammar
from lucedesk.engine.handle import RequestHandle, TokenLogprob
from lucedesk.engine.request import FinishReason, SamplingParams
from lucedesk.engine.tool_calls import Tool, ToolCall, ToolChoice
from lucedesk.engine.tool_parser import CallDelta, ReasoningDelta, TextDelta

if TYPE_CHECKING:
    from lucedesk.engine.engine import Engine
    from lucedesk.engine.models.chat import ReplyParser

Finish = Literal["stop", "length", "tool_calls", "error"]


@dataclass(slots=True)
class TurnRequest:
    """A chat turn (`messages` in tool_calls.py's neutral shape) or, with `prompt_ids`, a raw
    completion of those tokens. Sampling fields left None take the engine's defaults."""

    messages: list[dict] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_format: Grammar | None = None
    # How hard a reasoning model thinks: "none", "low", "medium", "high" (reasoning.LEVELS);
    # None: the model's default.
    reasoning: str | None = None
    prompt_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculative: bool | None = None  # prompt-lookup drafts; None = the engine's default
    logprobs: int | None = None
    prompt_field: str = "messages"  # named in the error for a prompt that leaves no room
    # Agents: shrink max_tokens to the room the prompt leaves instead of refusing the turn.
    fit_max_tokens: bool = False


@dataclass(slots=True, frozen=True)
class TextPiece:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True, frozen=True)
class ReasoningPiece:
    """Reasoning the model wrote before (or between) its answer."""

    text: str


@dataclass(slots=True, frozen=True)
class TurnEnd:
    finish: Finish
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of the last delta, not yet handed out
    stop_sequence: str | None = None


TurnEvent = TextPiece | ReasoningPiece | CallDelta | TurnEnd


@dataclass(slots=True)
class TurnResult:
    text: str
    calls: list[ToolCall]
    finish: Finish
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None
    logprobs: list[TokenLogprob]
    stop_sequence: str | None = None
    reasoning: str = ""


def encode(engine: Engine, req: TurnRequest):
    """The prompt tokens and the reply's parser (None without tools) for `req`; raises
    RequestError naming the bad field."""
    if req.prompt_ids is not None:
        grammar = req.response_format
        if grammar is not None:
            engine.check_grammar(grammar)
        return req.prompt_ids, grammar, None
    prompt = engine.encode_chat(
        req.messages,
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        req.response_format,
        req.reasoning,
    )
    return prompt.token_ids, prompt.grammar, prompt.parser()


def submit_turn(engine: Engine, req: TurnRequest, owner: str) -> Turn:
    """Encodes and submits; raises RequestError (the adapter answers it in its own shape)."""
    prompt_ids, grammar, parser = encode(engine, req)
    max_tokens = engine.output_room(len(prompt_ids), req.max_tokens, req.prompt_field)
    if req.fit_max_tokens:
        max_tokens = min(max_tokens, engine.output_room(len(prompt_ids), None))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=tuple(req.stop),
        ignore_eos=req.ignore_eos,
        speculative=req.speculative,
        grammar=grammar,
        logprobs=req.logprobs,
    )
    handle = engine.submit(prompt_ids, params, owner=owner)
    return Turn(engine, handle, parser)


class Turn:
    """A submitted turn. Read it once: `events()` while it streams, or `complete()`."""

    def __init__(self, engine: Engine, handle: RequestHandle, parser: ReplyParser | None):
        self.engine = engine
        self.handle = handle
        self.parser = parser
        self.num_prompt_tokens = handle.num_prompt_tokens
        self.finished = False

    def cancel(self) -> None:
        self.engine.cancel(self.handle.request_id)

    async def events(self) -> AsyncIterator[TurnEvent]:
        """The reply as it comes. Leaving the loop early (the client went away) cancels the
        request: its slot and blocks come back at the next engine step."""
        parser = self.parser
        try:
            async for out in self.handle:
                pieces = parser.feed(out.text) if parser is not None else []
                if out.finished and parser is not None:
                    pieces += parser.finish()
                if parser is None and out.text:
                    pieces = [TextDelta(out.text)]
                logprobs = out.logprobs
                for piece in pieces:
                    if isinstance(piece, TextDelta):
                        yield TextPiece(piece.text, logprobs)
                        logprobs = ()
                    elif isinstance(piece, ReasoningDelta):
                        yield ReasoningPiece(piece.text)
                    else:
                        yield piece
                if not out.finished:
                    if logprobs:  # tokens that made no text yet (held back, or inside a call)
                        yield TextPiece("", logprobs)
                    continue
                self.finished = True
                yield TurnEnd(
                    self._finish(out.finish_reason),
                    out.num_prompt_tokens,
                    out.num_output_tokens,
                    out.error,
                    logprobs,
                    out.stop_sequence,
                )
        finally:
            if not self.finished:
                self.cancel()

    async def complete(self, gone: Callable[[], Awaitable[bool]] | None = None) -> TurnResult:
        """The whole reply; cancels the request once `gone()` (polled twice a second) says
        its client went away."""
        result = asyncio.ensure_future(self.collect())
        try:
            while not result.done():
                await asyncio.wait({result}, timeout=0.5)
                if not result.done() and gone is not None and await gone():
                    self.cancel()
            return result.result()
        finally:
            if not result.done():
                self.cancel()
                result.cancel()

    async def collect(
        self,
        on_text: Callable[[str], None] | None = None,
        on_reasoning: Callable[[str], None] | None = None,
    ) -> TurnResult:
        """The whole reply; `on_text` sees its text as it comes, `on_reasoning` its
        reasoning. Cancelling the caller cancels the request."""
        text: list[str] = []
        reasoning: list[str] = []
        logprobs: list[TokenLogprob] = []
        end: TurnEnd | None = None
        async for event in self.events():
            if isinstance(event, TextPiece):
                text.append(event.text)
                logprobs.extend(event.logprobs)
                if on_text is not None and event.text:
                    on_text(event.text)
            elif isinstance(event, ReasoningPiece):
                reasoning.append(event.text)
                if on_reasoning is not None and event.text:
                    on_reasoning(event.text)
            elif isinstance(event, TurnEnd):
                logprobs.extend(event.logprobs)
                end = event
        assert end is not None
        calls = list(self.parser.calls) if self.parser is not None else []
        return TurnResult(
            "".join(text),
            calls,
            end.finish,
            end.num_prompt_tokens,
            end.num_output_tokens,
            end.error,
            logprobs,
            end.stop_sequence,
            "".join(reasoning),
        )

    def _finish(self, reason: FinishReason | None) -> Finish:
        if reason is FinishReason.ERROR:
            return "error"
        if reason is FinishReason.LENGTH:  # a call cut short too: the client must know
            return "length"
        if self.parser is not None and self.parser.calls:
            return "tool_calls"
        return "stop"
