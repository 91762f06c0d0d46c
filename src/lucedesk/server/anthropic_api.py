"""Anthropic Messages: `POST /v1/messages` (with its SSE event sequence) and
`POST /v1/messages/count_tokens`, what Claude Code and the `anthropic` SDK call."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from lucedesk.chat import (
    CallDelta,
    ChatEncoder,
    ReasoningPiece,
    TextPiece,
    TurnEnd,
    TurnResult,
)
from lucedesk.server.anthropic_wire import (
    CountTokensRequest,
    MessagesRequest,
    messages_of,
    to_turn_request,
    tools_of,
)
from lucedesk.server.errors import generation_failed
from lucedesk.server.replies import Json, TurnStream, dumps
from lucedesk.server.served import Served, complete, start_client_turn

log = logging.getLogger(__name__)


# -- requests into engine terms ---------------------------------------------------------------


# -- responses --------------------------------------------------------------------------------

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish: str, stop_sequence: str | None) -> str:
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS[finish]


def usage(end: TurnEnd | TurnResult) -> dict:
    """Anthropic's split: `input_tokens` are those computed, the prefix cache's hits are
    `cache_read_input_tokens`; together the prompt."""
    cached = end.num_cached_tokens
    return {
        "input_tokens": end.num_prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": end.num_output_tokens,
    }


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {dumps({'type': event, **data})}\n\n"


def routes(served: Served) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        served.check_model(body.model)
        turn = await start_client_turn(served.engine(), to_turn_request(body), request)
        mid = "msg_" + uuid.uuid4().hex[:24]
        omitted = body.thinking is not None and body.thinking.display == "omitted"
        if body.stream:
            return TurnStream(turn, stream(turn, mid, served.model_id, omitted))
        done = await complete(turn, request)
        content: list[dict] = []
        if done.reasoning:
            shown = "" if omitted else done.reasoning
            content.append({"type": "thinking", "thinking": shown, "signature": ""})
        if done.text.strip():
            content.append({"type": "text", "text": done.text})
        content += [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments_object()}
            for c in done.calls
        ]
        return Json(
            {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": served.model_id,
                "content": content,
                "stop_reason": stop_reason(done.finish, done.stop_sequence),
                "stop_sequence": done.stop_sequence,
                "usage": usage(done),
            }
        )

    @router.post("/v1/messages/count_tokens")
    def count_tokens(body: CountTokensRequest):  # sync: FastAPI runs it off the loop
        served.check_model(body.model)
        prompt = ChatEncoder.of(served.engine()).encode(messages_of(body), tools_of(body))
        return {"input_tokens": len(prompt.token_ids)}

    return router


async def stream(turn, mid: str, model: str, omitted: bool = False) -> AsyncIterator[str]:
    """message_start, ping, then per block content_block_start / _delta / _stop, then
    message_delta (stop_reason, usage) and message_stop."""
    yield sse(
        "message_start",
        {
            "message": {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": turn.num_prompt_tokens,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 0,
                },
            }
        },
    )
    yield sse("ping", {})
    blocks = Blocks()
    async for event in turn.events():
        if isinstance(event, ReasoningPiece) and event.text:
            for out in blocks.open(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""}
            ):
                yield out
            if not omitted:
                yield blocks.delta({"type": "thinking_delta", "thinking": event.text})
        elif isinstance(event, TextPiece) and event.text:
            for out in blocks.open("text", {"type": "text", "text": ""}):
                yield out
            yield blocks.delta({"type": "text_delta", "text": event.text})
        elif isinstance(event, CallDelta):
            if event.id is not None:
                block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
                for out in blocks.open(f"call{event.index}", block, new=True):
                    yield out
            if event.arguments:
                yield blocks.delta({"type": "input_json_delta", "partial_json": event.arguments})
        elif isinstance(event, TurnEnd):
            for out in blocks.close():
                yield out
            if event.finish == "error":
                error = {"type": "api_error", "message": generation_failed(event.error).message}
                yield sse("error", {"error": error})
                return
            yield sse(
                "message_delta",
                {
                    "delta": {
                        "stop_reason": stop_reason(event.finish, event.stop_sequence),
                        "stop_sequence": event.stop_sequence,
                    },
                    "usage": usage(event),
                },
            )
            yield sse("message_stop", {})


class Blocks:
    """The content blocks of a streamed message, opened and closed in order: a block of
    another kind closes the open one (a thinking block with its signature first)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def open(self, kind: str, block: dict, new: bool = False) -> list[str]:
        if self.kind == kind and not new:
            return []
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        events.append(sse("content_block_start", {"index": self.index, "content_block": block}))
        return events

    def delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        events = []
        if self.kind == "thinking":  # local reasoning carries an empty signature
            events.append(self.delta({"type": "signature_delta", "signature": ""}))
        if self.kind is not None:
            events.append(sse("content_block_stop", {"index": self.index}))
        self.kind = None
        return events
