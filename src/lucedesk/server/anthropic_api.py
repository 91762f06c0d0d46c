"""Anthropic Messages: `POST /v1/messages` (with its SSE event sequence) and
`POST /v1/messages/count_tokens`, what Claude Code and the `anthropic` SDK call."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from lucedesk.engine import (
    CallDelta,
    Grammar,
    ReasoningPiece,
    RequestError,
    TextPiece,
    Tool,
    ToolCall,
    ToolChoice,
    TurnEnd,
    TurnRequest,
    TurnResult,
)
from lucedesk.server.errors import TEXT_ONLY, APIError, not_text
from lucedesk.server.replies import Json, TurnStream, dumps
from lucedesk.server.served import Served, start_client_turn

log = logging.getLogger(__name__)


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class ThinkingBlock(BaseModel):
    """An earlier reply's reasoning, sent back (its signature, from lucedesk always empty,
    is not checked)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["redacted_thinking"]
    data: str = ""


class OtherBlock(BaseModel):
    """Blocks lucedesk does not serve (images, documents...): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


Block = (
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | OtherBlock
)


class Message(BaseModel):
    # A system entry inside `messages` (Claude Code sends them) is rendered where it stands
    # when the template allows, else joined to the leading system prompt.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoiceSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingSpec(BaseModel):
    """`thinking`: enabled (with a budget), disabled, or the model's own choice; `display:
    omitted` keeps the blocks and leaves their text out."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=0)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`output_config`: a JSON schema the reply's text must match (held by the grammar, as
    OpenAI's response_format is) and the effort, which sets the reasoning level."""

    model_config = ConfigDict(extra="allow")
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoiceSpec | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    thinking: ThinkingSpec | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None


# -- requests into engine terms ---------------------------------------------------------------


def _result_text(block: ToolResultBlock) -> str:
    """A tool result's text. An image or document a tool returned (a screenshot, a PDF)
    becomes a note saying so: refusing it would leave the conversation unusable, since the
    client sends it again every turn."""
    if isinstance(block.content, str):
        return block.content
    parts = []
    for part in block.content:
        if part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            parts.append(f"[{part.get('type', 'a')} content omitted: {TEXT_ONLY}]")
    return "\n".join(parts)


def messages_of(body: MessagesRequest | CountTokensRequest) -> list[dict]:
    """The neutral message list; raises RequestError for blocks that are not served and for
    a tool_result whose tool_use_id matches no earlier tool_use."""
    out: list[dict] = []
    if body.system:
        system = (
            body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        )
        out.append({"role": "system", "content": system})
    calls_made: dict[str, str] = {}
    for i, m in enumerate(body.messages):
        blocks = (
            [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        )
        text, calls, reasoning = [], [], []
        for j, block in enumerate(blocks):
            field = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ThinkingBlock | RedactedThinkingBlock) and m.role == "assistant":
                if isinstance(block, ThinkingBlock):  # redacted reasoning has no text to give
                    reasoning.append(block.thinking)
            elif isinstance(block, ToolUseBlock) and m.role == "assistant":
                calls_made[block.id] = block.name
                calls.append(ToolCall(block.id, block.name, json.dumps(block.input)))
            elif isinstance(block, ToolResultBlock) and m.role == "user":
                if block.tool_use_id not in calls_made:
                    raise RequestError(
                        f"{field}.tool_use_id {block.tool_use_id!r} matches no tool_use of an "
                        "earlier message",
                        f"{field}.tool_use_id",
                    )
                content = _result_text(block)
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "name": calls_made[block.tool_use_id],
                        "content": f"Error: {content}" if block.is_error else content,
                    }
                )
            elif block.type == "text":
                raise RequestError(f"{field}.text is required in a text block", f"{field}.text")
            elif block.type in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
                raise RequestError(
                    f"{field}: a {block.type} block cannot be in a {m.role} turn", field
                )
            else:
                raise RequestError(f"{field}: {not_text(block.type, 'blocks')}", field)
        if m.role == "system":
            out.append({"role": "system", "content": "".join(text)})
        elif m.role == "assistant":
            reply = {"role": "assistant", "content": "".join(text) or None, "tool_calls": calls}
            if reasoning:
                reply["reasoning"] = "\n".join(reasoning)
            out.append(reply)
        elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": "".join(text)})
    return out


def tools_of(body: MessagesRequest | CountTokensRequest) -> list[Tool]:
    """The client's own tools. Anthropic's versioned tools (`web_search_20250305`,
    `bash_20250124`, `text_editor_...`) are run by Anthropic or defined by it without a
    schema: they are left out, with a log line, so a client that always sends them works."""
    tools = []
    for i, t in enumerate(body.tools or []):
        kind = getattr(t, "type", None)
        if kind not in (None, "custom"):
            log.info("messages: tools[%d] of type %r is not served here; left out", i, kind)
            continue
        tools.append(Tool(t.name, t.description or "", t.input_schema))
    return tools


def reasoning_of(spec: ThinkingSpec | None) -> str | None:
    """`thinking` as a reasoning level: a budget picks one (under 4k tokens low, under 16k
    medium, else high), disabled is none, adaptive and between_tools the model's default."""
    if spec is None or spec.type in ("adaptive", "between_tools"):
        return None
    if spec.type == "disabled":
        return "none"
    budget = spec.budget_tokens
    if budget is None:
        return "medium"
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


def output_format_of(body: MessagesRequest) -> Grammar | None:
    if body.output_config is not None and body.output_config.format is not None:
        return Grammar.json_schema(body.output_config.format.schema_, "output_config.format")
    if body.output_format is not None:
        return Grammar.json_schema(body.output_format.schema_, "output_format")
    return None


def effort_of(body: MessagesRequest) -> str | None:
    """The reasoning level: `thinking` when sent, else `output_config.effort`."""
    if body.thinking is not None or body.output_config is None:
        return reasoning_of(body.thinking)
    effort = body.output_config.effort
    return None if effort is None else {"xhigh": "high", "max": "high"}.get(effort, effort)


def tool_choice_of(spec: ToolChoiceSpec | None) -> tuple[ToolChoice, bool]:
    """(the choice, whether parallel calls are allowed)."""
    if spec is None:
        return ToolChoice(), True
    parallel = not spec.disable_parallel_tool_use
    if spec.type == "tool":
        if not spec.name:
            raise RequestError(
                "tool_choice.name is required when type is 'tool'", "tool_choice.name"
            )
        return ToolChoice("function", spec.name), parallel
    return ToolChoice({"any": "required"}.get(spec.type, spec.type)), parallel


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
        choice, parallel = tool_choice_of(body.tool_choice)
        turn = await start_client_turn(
            served.engine(),
            TurnRequest(
                messages=messages_of(body),
                tools=tools_of(body),
                tool_choice=choice,
                parallel_tool_calls=parallel,
                max_tokens=body.max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                stop=tuple(body.stop_sequences or ()),
                reasoning=effort_of(body),
                response_format=output_format_of(body),
                field_names={"stop": "stop_sequences"},
            ),
            request,
        )
        mid = "msg_" + uuid.uuid4().hex[:24]
        omitted = body.thinking is not None and body.thinking.display == "omitted"
        if body.stream:
            return TurnStream(turn, stream(turn, mid, served.model_id, omitted))
        done = await turn.complete(request.is_disconnected)
        if done.finish == "error":
            raise APIError(500, f"generation failed: {done.error}", kind="server_error")
        content: list[dict] = []
        if done.reasoning:
            shown = "" if omitted else done.reasoning
            content.append({"type": "thinking", "thinking": shown, "signature": ""})
        if done.text.strip():
            content.append({"type": "text", "text": done.text})
        content += [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
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
        prompt = served.engine().encode_chat(messages_of(body), tools_of(body))
        return {"input_tokens": len(prompt.token_ids)}

    return router


def _input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is (a cut-off call: empty)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


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
                error = {"type": "api_error", "message": f"generation failed: {event.error}"}
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
