"""OpenAI Responses: `POST /v1/responses`, stateless (nothing is stored, so a request naming a
`previous_response_id` is refused): what Codex CLI and the `openai` SDK's responses call."""

from __future__ import annotations

import json
import logging
import time
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


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None


def _content_text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{field} must be a string or a list of parts", field)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise RequestError(f"{field}[{j}]: {not_text(kind)}", f"{field}[{j}]")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def messages_of(body: ResponsesRequest) -> list[dict]:
    out: list[dict] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    calls_made: dict[str, str] = {}
    reasoning = ""  # a reasoning item's text, for the assistant output after it
    for i, item in enumerate(body.input):
        field = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(
                    f"{field}.role must be user, assistant, system or developer", f"{field}.role"
                )
            text = _content_text(item.get("content", ""), f"{field}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
            if role == "assistant" and reasoning:
                out[-1]["reasoning"] = reasoning
            reasoning = ""  # reasoning goes with the output right after it, or nowhere
        elif kind == "function_call":
            call_id, name, arguments = (
                item.get("call_id"),
                item.get("name"),
                item.get("arguments", "{}"),
            )
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise RequestError(f"{field} needs call_id and name", field)
            try:
                json.loads(arguments)
            except (TypeError, json.JSONDecodeError):
                raise RequestError(
                    f"{field}.arguments is not valid JSON", f"{field}.arguments"
                ) from None
            calls_made[call_id] = name
            call = ToolCall(call_id, name, arguments)
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if reasoning:
                out[-1]["reasoning"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls_made:
                raise RequestError(
                    f"{field}.call_id {call_id!r} matches no earlier function_call",
                    f"{field}.call_id",
                )
            output = item.get("output", "")
            text = output if isinstance(output, str) else _content_text(output, f"{field}.output")
            reasoning = ""
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": calls_made[call_id],
                    "content": text,
                }
            )
        elif kind == "reasoning":  # the reasoning of the output that follows it
            reasoning = _reasoning_text(item)
        else:
            raise RequestError(
                f"{field}: {kind!r} items are not served ({TEXT_ONLY})", f"{field}.type"
            )
    return out


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary (Codex sends the
    item back without an id, and with content null)."""
    parts = item.get("content") or []
    texts = [p.get("text", "") for p in parts if isinstance(p, dict)]
    if not any(texts):
        summary = item.get("summary") or []
        texts = [p.get("text", "") for p in summary if isinstance(p, dict)]
    return "\n".join(str(t) for t in texts if t)


def tools_of(body: ResponsesRequest) -> list[Tool]:
    """The function tools. Hosted tools (web search, a local shell...) are OpenAI's to run:
    they are left out, with a log line, so a client that always sends them still works."""
    tools = []
    for i, t in enumerate(body.tools or []):
        if t.type != "function":
            log.info("responses: tools[%d] of type %r is not served here; left out", i, t.type)
            continue
        if not t.name:
            raise RequestError(f"tools[{i}].name is required for a function tool", f"tools[{i}]")
        tools.append(Tool(t.name, t.description or "", t.parameters or {"type": "object"}))
    return tools


def grammar_of(body: ResponsesRequest) -> Grammar | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar.json_object("text.format")
    if fmt.schema_ is None:
        raise RequestError("text.format.schema is required for json_schema", "text.format.schema")
    return Grammar.json_schema(fmt.schema_, "text.format")


class Response:
    """Builds the response object and its output items, whole or as stream events."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body = body
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.sequence = 0

    def envelope(
        self, status: str, output: list[dict], usage: dict | None, finish: str | None
    ) -> dict:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": {"type": "text"}}
            if body.text is None
            else body.text.model_dump(by_alias=True),
            "tool_choice": body.tool_choice
            if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(),
            "tools": [t.model_dump() for t in body.tools or []],
            "metadata": {},
        }

    @staticmethod
    def usage(end: TurnEnd | TurnResult) -> dict:
        num_prompt, num_output = end.num_prompt_tokens, end.num_output_tokens
        return {
            "input_tokens": num_prompt,
            "input_tokens_details": {
                "cached_tokens": end.num_cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt + num_output,
        }

    @staticmethod
    def message_item(item_id: str, text: str, status: str = "completed") -> dict:
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed"
            else [],
        }

    @staticmethod
    def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
        """Raw reasoning as `reasoning_text` content; no summary is written."""
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    @staticmethod
    def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": status,
        }

    def whole(self, done: TurnResult) -> dict:
        output = []
        if done.reasoning:
            output.append(self.reasoning_item("rs_" + uuid.uuid4().hex[:24], done.reasoning))
        if done.text.strip() or not done.calls:
            output.append(self.message_item("msg_" + uuid.uuid4().hex[:24], done.text))
        output += [self.call_item("fc_" + uuid.uuid4().hex[:24], c) for c in done.calls]
        if done.cut_call:  # max_output_tokens ended it mid-arguments
            output[-1]["status"] = "incomplete"
        status = "incomplete" if done.finish == "length" else "completed"
        usage = self.usage(done)
        return self.envelope(status, output, usage, done.finish)

    def event(self, kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps(payload)}\n\n"

    async def stream(self, turn) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.envelope("in_progress", [], None, None))
        yield self.event(
            "response.in_progress", response=self.envelope("in_progress", [], None, None)
        )
        output: list[dict] = []
        item: dict | None = None  # the open output item
        text = ""

        def close_item(call_status: str = "completed"):
            nonlocal item, text
            events = []
            index = len(output)
            loc = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": []}
                events.append(
                    self.event("response.output_text.done", **loc, text=text, logprobs=[])
                )
                events.append(self.event("response.content_part.done", **loc, part=part))
                item = self.message_item(item["id"], text)
            elif item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                events.append(self.event("response.reasoning_text.done", **loc, text=text))
                events.append(self.event("response.content_part.done", **loc, part=part))
                item = self.reasoning_item(item["id"], text)
            else:
                item["status"] = call_status
                events.append(
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                    )
                )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
            output.append(item)
            item, text = None, ""
            return events

        def open_item(kind: str, part: dict):
            nonlocal item
            events = []
            if item is not None and item["type"] != kind:
                events += close_item()
            if item is None:
                make = self.message_item if kind == "message" else self.reasoning_item
                item = make(
                    ("msg_" if kind == "message" else "rs_") + uuid.uuid4().hex[:24],
                    "",
                    "in_progress",
                )
                index = len(output)
                events.append(
                    self.event("response.output_item.added", output_index=index, item=item)
                )
                events.append(
                    self.event(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                )
            return events

        async for event in turn.events():
            if isinstance(event, ReasoningPiece) and event.text:
                for e in open_item("reasoning", {"type": "reasoning_text", "text": ""}):
                    yield e
                text += event.text
                yield self.event(
                    "response.reasoning_text.delta",
                    item_id=item["id"],
                    output_index=len(output),
                    content_index=0,
                    delta=event.text,
                )
            elif isinstance(event, TextPiece) and event.text:
                part = {"type": "output_text", "text": "", "annotations": []}
                for e in open_item("message", part):
                    yield e
                text += event.text
                yield self.event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=len(output),
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            elif isinstance(event, CallDelta):
                if event.id is not None:
                    if item is not None:
                        for e in close_item():
                            yield e
                    call = ToolCall(event.id, event.name or "", "")
                    item = self.call_item("fc_" + uuid.uuid4().hex[:24], call, "in_progress")
                    yield self.event(
                        "response.output_item.added", output_index=len(output), item=item
                    )
                if event.arguments:
                    item["arguments"] += event.arguments
                    yield self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=len(output),
                        delta=event.arguments,
                    )
            elif isinstance(event, TurnEnd):
                if item is not None:  # a call max_output_tokens ended is incomplete
                    for e in close_item("incomplete" if event.cut_call else "completed"):
                        yield e
                if event.finish == "error":
                    failed = self.envelope("failed", output, None, None)
                    failed["error"] = {
                        "code": "server_error",
                        "message": f"generation failed: {event.error}",
                    }
                    yield self.event("response.failed", response=failed)
                    return
                usage = self.usage(event)
                if event.finish == "length":
                    done = self.envelope("incomplete", output, usage, "length")
                    yield self.event("response.incomplete", response=done)
                else:
                    done = self.envelope("completed", output, usage, event.finish)
                    yield self.event("response.completed", response=done)


def routes(served: Served) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        served.check_model(body.model)
        if body.previous_response_id is not None:
            raise APIError(
                400,
                "previous_response_id: responses are not stored here (store: false); send the "
                "whole conversation as input items",
                "previous_response_id",
            )
        choice = body.tool_choice
        turn = await start_client_turn(
            served.engine(),
            TurnRequest(
                messages=messages_of(body),
                tools=tools_of(body),
                tool_choice=ToolChoice("function", choice.name)
                if isinstance(choice, FunctionChoice)
                else ToolChoice(choice or "auto"),
                parallel_tool_calls=body.parallel_tool_calls,
                response_format=grammar_of(body),
                reasoning=body.reasoning.effort if body.reasoning else None,
                max_tokens=body.max_output_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                prompt_field="input",
                field_names={"max_tokens": "max_output_tokens"},
            ),
            request,
        )
        response = Response(body, served.model_id)
        if body.stream:
            return TurnStream(turn, response.stream(turn))
        done = await turn.complete(request.is_disconnected)
        if done.finish == "error":
            raise APIError(500, f"generation failed: {done.error}", kind="server_error")
        return Json(response.whole(done))

    return router
