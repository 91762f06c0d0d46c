"""The Ollama API beside /v1 on the same port: `/api/version`, `/api/tags`, `/api/show`,
`/api/ps`, `/api/chat` and `/api/generate` (NDJSON streams by default), `/api/embed`
(answered 501: this engine serves no embeddings). What Open WebUI, the `ollama` package and
editor plugins that only know Ollama call."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from lucedesk import __version__
from lucedesk.engine import (
    CallDelta,
    Grammar,
    ReasoningPiece,
    RequestError,
    TextPiece,
    Tool,
    ToolCall,
    TurnEnd,
    TurnRequest,
)
from lucedesk.server.errors import IMAGES, APIError
from lucedesk.server.openai_wire import NamedToolChoice, tool_choice_of
from lucedesk.server.replies import Json, TurnStream, dumps
from lucedesk.server.served import Served, start_client_turn

# The Ollama API release whose routes and shapes this adapter follows (clients compare it).
OLLAMA_API_VERSION = "0.12.0"


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = ""
    thinking: str | None = None  # an earlier reply's reasoning
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None


# `think`: on or off, or a level (gpt-oss takes the levels only).
Think = bool | Literal["low", "medium", "high", "max"] | None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(default_factory=list)
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
        return Grammar.json_object("format")
    if isinstance(fmt, dict):
        return Grammar.json_schema(fmt, "format")
    raise RequestError(f"format must be 'json' or a JSON schema (got {fmt!r})", "format")


def sampling_of(options: Options | None) -> dict:
    o = options or Options()
    return dict(
        max_tokens=o.num_predict if o.num_predict and o.num_predict > 0 else None,
        temperature=o.temperature,
        top_p=o.top_p,
        top_k=o.top_k,
        min_p=o.min_p,
        seed=o.seed,
        stop=tuple(o.stop or ()),
        ignore_eos=bool(o.ignore_eos),
        speculative=o.speculative,
        field_names={
            "max_tokens": "options.num_predict",
            **{f: f"options.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "stop")},
        },
    )


def reasoning_of(think: Think, served: Served) -> str | None:
    """`think` as a reasoning level; asking a model that does not reason to think is an
    error, as in Ollama."""
    if think is None:
        return None
    if think is not False and served.engine().reasoning_format is None:
        raise APIError(400, f'"{served.model_id}" does not support thinking', "think")
    if isinstance(think, bool):
        return "medium" if think else "none"
    return think


def messages_of(body: ChatRequest) -> list[dict]:
    """Ollama's calls carry no ids: each call gets one, and a tool message answers the
    earliest unanswered call (of its `tool_name`, when given)."""
    out: list[dict] = []
    pending: list[ToolCall] = []
    for i, m in enumerate(body.messages):
        if m.images:
            raise RequestError(f"messages[{i}].images: {IMAGES}", f"messages[{i}].images")
        if m.role == "assistant" and m.tool_calls:
            calls = [
                ToolCall(f"call_{i}_{j}", c.function.name, json.dumps(c.function.arguments))
                for j, c in enumerate(m.tool_calls)
            ]
            pending.extend(calls)
            reply = {"role": "assistant", "content": m.content or None, "tool_calls": calls}
            out.append(reply | ({"reasoning": m.thinking} if m.thinking else {}))
        elif m.role == "tool":
            match = next((c for c in pending if m.tool_name in (None, c.name)), None)
            if match is None:
                raise RequestError(
                    f"messages[{i}] is a tool result but no earlier tool call awaits one",
                    f"messages[{i}]",
                )
            pending.remove(match)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": match.id,
                    "name": match.name,
                    "content": m.content or "",
                }
            )
        elif m.role in ("system", "user", "assistant"):
            message = {"role": m.role, "content": m.content or ""}
            if m.role == "assistant" and m.thinking:
                message["reasoning"] = m.thinking
            out.append(message)
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


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def routes(served: Served) -> APIRouter:
    router = APIRouter()

    def details() -> dict:
        info = served.engine().model_info
        return {
            "parent_model": "",
            "format": "gguf" if info.path.endswith(".gguf") else "safetensors",
            "family": info.architecture,
            "families": [info.architecture],
            "parameter_size": "",
            "quantization_level": info.quantization,
        }

    def entry() -> dict:
        info = served.engine().model_info
        return {
            "name": served.model_id,
            "model": served.model_id,
            "modified_at": now(),
            "size": _file_size(info.path),
            "digest": "",
            "details": details(),
        }

    def model_named(body: ModelRequest) -> None:
        served.check_model(body.model or body.name)

    @router.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_API_VERSION, "lucedesk": __version__}

    @router.get("/api/tags")
    async def tags() -> dict:
        return {"models": [entry()]}

    @router.get("/api/ps")
    async def ps() -> dict:
        info = served.engine().model_info
        running = {**entry(), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0}
        return {"models": [{**running, "context_length": info.context_length}]}

    @router.post("/api/show")
    async def show(body: ModelRequest) -> dict:
        model_named(body)
        eng = served.engine()
        info = eng.model_info
        arch = info.architecture or "llama"
        return {
            "modelfile": f"FROM {info.path}",
            "parameters": "",
            "template": eng.tokenizer.chat_template or "",
            "details": details(),
            "model_info": {
                "general.architecture": arch,
                f"{arch}.context_length": info.context_length,
            },
            "capabilities": ["completion", "tools"]
            + (["thinking"] if eng.reasoning_format is not None else []),
        }

    # Not an operation this server offers, so kept out of the OpenAPI document.
    @router.post("/api/embed", include_in_schema=False)
    @router.post("/api/embeddings", include_in_schema=False)
    async def embed():
        raise APIError(501, "embeddings are not served: this engine runs a generative model only")

    @router.post("/api/chat")
    async def chat(body: ChatRequest, request: Request):
        served.check_model(body.model)
        if not body.messages:  # Ollama's way to load a model: answer at once
            return Json(_done_line(served.model_id, "load", 0, 0, 0.0, chat=True))
        turn = await start_client_turn(
            served.engine(),
            TurnRequest(
                messages=messages_of(body),
                tools=tools_of(body),
                tool_choice=tool_choice_of(body),
                response_format=grammar_of(body.format),
                reasoning=reasoning_of(body.think, served),
                **sampling_of(body.options),
            ),
            request,
        )
        return await answer(turn, body.stream, served.model_id, request, chat=True)

    @router.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request):
        served.check_model(body.model)
        if body.images:
            raise APIError(400, f"images: {IMAGES}", "images")
        if not body.prompt:  # loads the model: answer at once
            return Json(_done_line(served.model_id, "load", 0, 0, 0.0, chat=False))
        eng = served.engine()
        if body.raw:
            request_fields = {"prompt_text": body.prompt}
        else:
            messages = [{"role": "system", "content": body.system}] if body.system else []
            messages.append({"role": "user", "content": body.prompt})
            request_fields = {"messages": messages}
        turn = await start_client_turn(
            eng,
            TurnRequest(
                **request_fields,
                prompt_field="prompt",
                response_format=grammar_of(body.format),
                reasoning=reasoning_of(body.think, served),
                **sampling_of(body.options),
            ),
            request,
        )
        return await answer(turn, body.stream, served.model_id, request, chat=False)

    return router


def _file_size(path: str) -> int:
    import os

    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _done_line(
    model: str, reason: str, num_prompt: int, num_output: int, seconds: float, chat: bool
) -> dict:
    line: dict = {"model": model, "created_at": now()}
    if chat:
        line["message"] = {"role": "assistant", "content": ""}
    else:
        line["response"] = ""
    nanos = int(seconds * 1e9)
    line.update(
        done=True,
        done_reason=reason,
        total_duration=nanos,
        load_duration=0,
        prompt_eval_count=num_prompt,
        prompt_eval_duration=0,
        eval_count=num_output,
        eval_duration=nanos,
    )
    return line


async def answer(turn, stream: bool, model: str, request: Request, chat: bool):
    started = time.perf_counter()
    if not stream:
        done = await turn.complete(request.is_disconnected)
        if done.finish == "error":
            raise APIError(500, f"generation failed: {done.error}", kind="server_error")
        line = _done_line(
            model,
            "length" if done.finish == "length" else "stop",
            done.num_prompt_tokens,
            done.num_output_tokens,
            time.perf_counter() - started,
            chat,
        )
        if chat:
            line["message"]["content"] = done.text
            if done.reasoning:
                line["message"]["thinking"] = done.reasoning
            if done.calls:
                line["message"]["tool_calls"] = [_call(c) for c in done.calls]
        else:
            line["response"] = done.text
            if done.reasoning:
                line["thinking"] = done.reasoning
        return Json(line)
    return TurnStream(turn, ndjson(turn, model, chat, started), "application/x-ndjson")


def _call(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {}
    return {"function": {"name": call.name, "arguments": arguments}}


async def ndjson(turn, model: str, chat: bool, started: float) -> AsyncIterator[str]:
    """One JSON object a line: text as it comes, a call once it is whole, then the last line
    with done, done_reason and the counts."""

    def line(obj: dict) -> str:
        return dumps(obj) + "\n"

    def piece(text: str, calls: list[dict] | None = None, thinking: str = "") -> dict:
        if chat:
            message: dict = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"model": model, "created_at": now(), "message": message, "done": False}
        out = {"model": model, "created_at": now(), "response": text, "done": False}
        return out | ({"thinking": thinking} if thinking else {})

    parser = turn.parser
    num_calls_sent = 0
    async for event in turn.events():
        if isinstance(event, ReasoningPiece) and event.text:
            yield line(piece("", thinking=event.text))
        elif isinstance(event, TextPiece) and event.text:
            yield line(piece(event.text))
        elif isinstance(event, CallDelta | TurnEnd) and parser is not None:
            finished = parser.calls[num_calls_sent:]  # calls whose envelope closed
            if finished:
                num_calls_sent += len(finished)
                yield line(piece("", [_call(c) for c in finished]))
        if isinstance(event, TurnEnd):
            if event.finish == "error":
                yield line({"error": f"generation failed: {event.error}"})
                return
            reason = "length" if event.finish == "length" else "stop"
            yield line(
                _done_line(
                    model,
                    reason,
                    event.num_prompt_tokens,
                    event.num_output_tokens,
                    time.perf_counter() - started,
                    chat,
                )
            )
