"""OpenAI Responses' wire format: the request models and their conversion into a chat turn
(typed messages from input items, tools, text format)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lucedesk.chat import (
    CallLedger,
    ChatMessage,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
    TurnRequest,
    WireNames,
    json_object,
    schema_grammar,
)
from lucedesk.engine import Grammar, RequestError
from lucedesk.server.errors import TEXT_ONLY, not_text

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


def messages_of(body: ResponsesRequest) -> list[ChatMessage]:
    """The chat, typed: instructions, then the input items (messages, function calls and
    their outputs, reasoning that goes with the output after it)."""
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage("system", body.instructions))
    if isinstance(body.input, str):
        return [*out, ChatMessage("user", body.input)]
    ledger = CallLedger()
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
            role = "system" if role == "developer" else role
            out.append(ChatMessage(role, text, reasoning=reasoning if role == "assistant" else ""))
            reasoning = ""  # reasoning goes with the output right after it, or nowhere
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise RequestError(f"{field} needs call_id and name", field)
            call = ToolCall(call_id, name, item.get("arguments", "{}"))
            ledger.made(call, f"{field}.arguments")
            if not (out and out[-1].role == "assistant"):  # calls join the reply before them
                out.append(ChatMessage("assistant"))
            out[-1].tool_calls.append(call)
            if reasoning:
                out[-1].reasoning, reasoning = reasoning, ""
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _content_text(output, f"{field}.output")
            reasoning = ""
            out.append(
                ledger.answer(item.get("call_id"), text, f"{field}.call_id", "function_call")
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


def to_turn_request(body: ResponsesRequest) -> TurnRequest:
    choice = body.tool_choice
    return TurnRequest(
        messages=messages_of(body),
        tools=tools_of(body),
        tool_choice=ToolChoice("function", choice.name)
        if isinstance(choice, FunctionChoice)
        else ToolChoice(choice or "auto"),
        parallel_tool_calls=body.parallel_tool_calls,
        reasoning=body.reasoning.effort if body.reasoning else None,
        response_format=grammar_of(body),
        sampling=Sampling(
            max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p
        ),
        names=WireNames("input", {"max_tokens": "max_output_tokens"}),
    )


def grammar_of(body: ResponsesRequest) -> Grammar | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_object("text.format")
    if fmt.schema_ is None:
        raise RequestError("text.format.schema is required for json_schema", "text.format.schema")
    return schema_grammar(fmt.schema_, "text.format")
