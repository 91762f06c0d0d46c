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
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from lucedesk.chat.encoder import ChatEncoder, ChatPrompt
from lucedesk.chat.formats import ReplyParser
from lucedesk.chat.json_schema import check_value
from lucedesk.chat.messages import ToolCall
from lucedesk.chat.repeated_calls import RepeatedCalls
from lucedesk.chat.stops import FreeTextStops
from lucedesk.chat.tool_parser import CallDelta, ReasoningDelta, TextDelta
from lucedesk.chat.turn_request import TurnRequest
from lucedesk.engine import FinishReason, RequestHandle, SamplingParams, TokenLogprob
from lucedesk.errors import RequestError

if TYPE_CHECKING:
    from lucedesk.engine import Engine

log = logging.getLogger(__name__)

Finish = Literal["stop", "length", "tool_calls", "error"]


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
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held
    cut_call: bool = False  # max_tokens ended the reply inside its last call


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
    num_cached_tokens: int = 0
    cut_call: bool = False


def encode(engine: Engine, req: TurnRequest) -> ChatPrompt:
    """The prompt for `req`: its tokens, the grammar its reply must follow, and how to read
    the reply back; raises RequestError naming the bad field."""
    if req.raw is None:
        return ChatEncoder.of(engine).encode(
            req.messages,
            req.tools,
            req.tool_choice,
            req.parallel_tool_calls,
            req.response_format,
            req.reasoning,
            req.continue_final,
        )
    ids = req.raw.ids if req.raw.text is None else engine.tokenizer.encode(req.raw.text)
    grammar = req.response_format
    strict: dict[str | None, object] = {}
    if grammar is not None:
        engine.check_grammar(grammar)
        if grammar.strict is not None:
            strict[None] = json.loads(grammar.strict)
    return ChatPrompt(list(ids or []), grammar, strict=strict)


def count_prompt(engine: Engine, req: TurnRequest) -> int:
    """The tokens of `req`'s prompt as `engine`'s model reads it."""
    return len(encode(engine, req).token_ids)


def submit_turn(engine: Engine, req: TurnRequest, owner: str) -> Turn:
    """Encodes and submits; raises RequestError (the adapter answers it in its own shape)."""
    prompt = encode(engine, req)
    parser = prompt.parser()
    s = req.sampling
    # max_tokens is an upper bound: capped to the room the prompt leaves, as peers do.
    max_tokens = engine.output_room(len(prompt.token_ids), s.max_tokens, req.names.prompt)
    # Stop strings end free text only, never a call or a schema the grammar holds: with a
    # parser the turn looks for them in the answer's text (`free_stops`); a reply the
    # grammar holds whole has none.
    engine_stops, free_stops = tuple(s.stop), ()
    if prompt.grammar is not None or parser is not None:
        if parser is not None and req.response_format is None:
            free_stops = engine_stops
        engine_stops = ()
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        top_k=s.top_k or 0,
        min_p=s.min_p or 0.0,
        seed=s.seed,
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
        speculative=s.speculative,
        grammar=prompt.grammar,
        logprobs=s.logprobs,
    )
    try:
        params.validate()  # the stop strings too, wherever they are looked for
    except RequestError as exc:
        name = req.names.fields.get(exc.field or "")
        if name is None:
            raise
        raise RequestError(name + str(exc).removeprefix(exc.field or ""), name) from None
    params = dataclasses.replace(params, stop=engine_stops)
    handle = engine.submit(prompt.token_ids, params, owner=owner, interactive=req.interactive)
    return Turn(engine, handle, parser, prompt.strict, free_stops)


async def start_turn(engine: Engine, req: TurnRequest, owner: str) -> Turn:
    """submit_turn off the event loop: a long prompt's template and tokenizer run take
    seconds, which would stall every other client of that loop. A caller cancelled while
    it runs leaves no request behind: the turn is cancelled once submitted."""
    submitted = asyncio.get_running_loop().run_in_executor(None, submit_turn, engine, req, owner)
    try:
        return await asyncio.shield(submitted)
    except asyncio.CancelledError:
        submitted.add_done_callback(_cancel_submitted)
        raise


def _cancel_submitted(submitted: asyncio.Future) -> None:
    if not submitted.cancelled() and submitted.exception() is None:
        submitted.result().cancel()


class Turn:
    """A submitted turn. Read it once: `events()` while it streams, or `complete()`.
    `strict` holds the whole schemas its grammar held only part of (a tool's by name, the
    answer's under None): the reply is checked against them when it ends, and what fails is
    logged (a client validates calls itself; lucedesk's agent answers the model with it)."""

    def __init__(
        self,
        engine: Engine,
        handle: RequestHandle,
        parser: ReplyParser | None,
        strict: dict[str | None, object] | None = None,
        stops: tuple[str, ...] = (),
    ):
        self.engine = engine
        self.handle = handle
        self.parser = parser
        self.strict = strict or {}
        self.stops = FreeTextStops(stops) if stops else None
        self.num_prompt_tokens = handle.num_prompt_tokens
        self.num_output_tokens = 0  # so far
        self.first_token_at: float | None = None  # time.monotonic() of the first token
        self.finished = False
        self._text: list[str] = []

    def cancel(self) -> None:
        self.engine.cancel(self.handle.request_id)

    async def events(self) -> AsyncIterator[TurnEvent]:
        """The reply as it comes. Leaving the loop early (the client went away) cancels the
        request: its slot and blocks come back at the next engine step."""
        parser = self.parser
        repeats = RepeatedCalls(parser) if parser is not None else None
        try:
            async for out in self.handle:
                self.num_output_tokens = out.num_output_tokens
                if self.first_token_at is None and out.num_output_tokens:
                    self.first_token_at = time.monotonic()
                pieces = parser.feed(out.text) if parser is not None else []
                if out.finished and parser is not None:
                    pieces += parser.finish(out.finish_reason is FinishReason.LENGTH)
                if repeats is not None:
                    pieces = repeats.filter(pieces)
                if parser is None and out.text:
                    pieces = [TextDelta(out.text)]
                logprobs = out.logprobs
                stops = self.stops
                if stops is not None and out.finished:
                    pieces.append(TextDelta(""))  # the end: what stops held back goes out
                for piece in pieces:
                    if isinstance(piece, TextDelta):
                        text, stop = piece.text, None
                        if stops is not None:
                            text, stop = stops.feed(text, final=out.finished)
                        if None in self.strict:
                            self._text.append(text)
                        if text or logprobs:
                            yield TextPiece(text, logprobs)
                        logprobs = ()
                        if stop is not None:  # the request ends here
                            self.finished = True
                            self.cancel()
                            yield TurnEnd(
                                "stop",
                                out.num_prompt_tokens,
                                out.num_output_tokens,
                                stop_sequence=stop,
                                num_cached_tokens=out.num_cached_tokens,
                            )
                            return
                        continue
                    if stops is not None and stops.held:  # the free text ended before it
                        yield TextPiece(stops.feed("", final=True)[0])
                    if isinstance(piece, ReasoningDelta):
                        yield ReasoningPiece(piece.text)
                    else:
                        yield piece
                if repeats is not None and repeats.repeated:  # the reply ends at its calls
                    self.finished = True
                    self.cancel()
                    yield TurnEnd(
                        "tool_calls",
                        out.num_prompt_tokens,
                        out.num_output_tokens,
                        num_cached_tokens=out.num_cached_tokens,
                    )
                    return
                if not out.finished:
                    if logprobs:  # tokens that made no text yet (held back, or inside a call)
                        yield TextPiece("", logprobs)
                    continue
                self.finished = True
                if self.strict and out.finish_reason is not FinishReason.LENGTH:
                    self._check_strict()
                yield TurnEnd(
                    self._finish(out.finish_reason),
                    out.num_prompt_tokens,
                    out.num_output_tokens,
                    out.error,
                    logprobs,
                    out.stop_sequence,
                    out.num_cached_tokens,
                    parser is not None and parser.incomplete,
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
            end.num_cached_tokens,
            end.cut_call,
        )

    def _check_strict(self) -> None:
        replies: list[tuple[str | None, str, str]] = []  # (schema key, what, its JSON)
        if None in self.strict and self._text:
            replies.append((None, "the answer", "".join(self._text)))
        for call in self.parser.calls if self.parser is not None else []:
            if call.name in self.strict:
                replies.append((call.name, f"a call of {call.name}", call.arguments))
        for key, what, text in replies:
            try:
                problem = check_value(self.strict[key], json.loads(text))
            except json.JSONDecodeError:
                problem = "not JSON"
            if problem is not None:
                log.warning(
                    "%s (%s) breaks a schema keyword the grammar cannot hold: %s",
                    what,
                    self.handle.request_id,
                    problem,
                )

    def _finish(self, reason: FinishReason | None) -> Finish:
        if reason is FinishReason.ERROR:
            return "error"
        if reason is FinishReason.LENGTH:  # a call cut short too: the client must know
            return "length"
        if self.parser is not None and self.parser.calls:
            return "tool_calls"
        return "stop"
