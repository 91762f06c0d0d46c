"""Ollama's wire format: the request models and their conversion into a chat turn (typed
messages, tools, options as sampling fields, format as a grammar)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lucedesk.chat import (
    CallLedger,
    ChatMessage,
    RawPrompt,
    Sampling,
    Tool,
    ToolCall,
    TurnRequest,
    WireNames,
    json_object,
    schema_grammar,
)
from lucedesk.engine import Grammar, RequestError
from lucedesk.server.errors import IMAGES
from lucedesk.server.openai_wire import NamedToolChoice, tool_choice_of

# How hard a model thinks: a switch, or gpt-oss's levels.
Think = bool | Literal["low", "medium", "high", "max"] | None


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")  # num_ctx, num_gpu, ...: the engine decides those
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    ignore_eos: bool | None = None  # an extension, as on the OpenAI routes
    speculative: bool | None = None  # likewise: prompt-lookup drafts


class FunctionCall(BaseModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallIn(BaseModel):
    function: FunctionCall


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = ""
    thinking: str | None = None  # an earlier reply's reasoning
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[MessageIn] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: Think = None
    # An extension (Ollama has no way to force a call): OpenAI's values.
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: Think = None


class ModelRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # older clients send `name`


def grammar_of(fmt: str | dict | None) -> Grammar | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json_object("format")
    if isinstance(fmt, dict):
        return schema_grammar(fmt, "format")
    raise RequestError(f"format must be 'json' or a JSON schema (got {fmt!r})", "format")


def to_turn_request(body: ChatRequest | GenerateRequest, reasoning: str | None) -> TurnRequest:
    """A chat's turn, or a generate's: its prompt (raw, or as a user message under the
    system one) under the options; `reasoning` is `think` as a level (ollama_api)."""
    sampling, names = sampling_of(body.options)
    if isinstance(body, ChatRequest):
        return TurnRequest(
            messages=messages_of(body),
            tools=tools_of(body),
            tool_choice=tool_choice_of(body),
            reasoning=reasoning,
            response_format=grammar_of(body.format),
            sampling=sampling,
            names=names,
        )
    names.prompt = "prompt"
    if body.raw:
        return TurnRequest(
            raw=RawPrompt(text=body.prompt),
            response_format=grammar_of(body.format),
            sampling=sampling,
            names=names,
        )
    messages = [ChatMessage("system", body.system)] if body.system else []
    messages.append(ChatMessage("user", body.prompt))
    return TurnRequest(
        messages=messages,
        reasoning=reasoning,
        response_format=grammar_of(body.format),
        sampling=sampling,
        names=names,
    )


def sampling_of(options: Options | None) -> tuple[Sampling, WireNames]:
    o = options or Options()
    sampling = Sampling(
        max_tokens=o.num_predict if o.num_predict and o.num_predict > 0 else None,
        temperature=o.temperature,
        top_p=o.top_p,
        top_k=o.top_k,
        min_p=o.min_p,
        seed=o.seed,
        stop=tuple(o.stop or ()),
        ignore_eos=bool(o.ignore_eos),
        speculative=o.speculative,
    )
    fields = {"max_tokens": "options.num_predict"}
    fields |= {f: f"options.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "stop")}
    return sampling, WireNames(fields=fields)


def messages_of(body: ChatRequest) -> list[ChatMessage]:
    """The chat, typed. Ollama's calls carry no ids: each call gets one, and a tool message
    answers the earliest unanswered call (of its `tool_name`, when given)."""
    out: list[ChatMessage] = []
    ledger = CallLedger()
    for i, m in enumerate(body.messages):
        if m.images:
            raise RequestError(f"messages[{i}].images: {IMAGES}", f"messages[{i}].images")
        if m.role == "tool":
            out.append(ledger.answer_next(m.tool_name, m.content or "", f"messages[{i}]"))
        elif m.role in ("system", "user", "assistant"):
            calls = [
                ledger.made(
                    ToolCall(f"call_{i}_{j}", c.function.name, json.dumps(c.function.arguments))
                )
                for j, c in enumerate((m.tool_calls or []) if m.role == "assistant" else [])
            ]
            reasoning = (m.thinking or "") if m.role == "assistant" else ""
            out.append(ChatMessage(m.role, m.content or "", calls, reasoning))
        else:
            raise RequestError(
                f"messages[{i}].role must be system, user, assistant or tool", f"messages[{i}].role"
            )
    return out


def tools_of(body: ChatRequest) -> list[Tool]:
    tools = []
    for i, t in enumerate(body.tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}] needs function.name", f"tools[{i}]")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        tools.append(Tool(fn["name"], str(fn.get("description") or ""), params))
    return tools
