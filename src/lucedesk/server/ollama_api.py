"""The Ollama API beside /v1 on the same port: `/api/version`, `/api/tags`, `/api/show`,
`/api/ps`, `/api/chat` and `/api/generate` (NDJSON streams by default), `/api/embed`
(answered 501: this engine serves no embeddings). What Open WebUI, the `ollama` package and
editor plugins that only know Ollama call."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from fastapi import APIRouter, Request

from lucedesk import __version__
from lucedesk.chat import (
    CallDelta,
    ReasoningPiece,
    TextPiece,
    ToolCall,
    TurnEnd,
    reasoning_format,
)
from lucedesk.server.errors import IMAGES, APIError, generation_failed
from lucedesk.server.ollama_wire import (
    ChatRequest,
    GenerateRequest,
    ModelRequest,
    Think,
    to_turn_request,
)
from lucedesk.server.replies import Json, TurnStream, dumps
from lucedesk.server.served import Served, complete, start_client_turn

# The Ollama API release whose routes and shapes this adapter follows (clients compare it).
OLLAMA_API_VERSION = "0.12.0"


def reasoning_of(think: Think, served: Served) -> str | None:
    """`think` as a reasoning level; asking a model that does not reason to think is an
    error, as in Ollama."""
    if think is None:
        return None
    if think is not False and reasoning_format(served.engine().tokenizer.chat_template) is None:
        raise APIError(400, f'"{served.model_id}" does not support thinking', "think")
    if isinstance(think, bool):
        return "medium" if think else "none"
    return think


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
            + (["thinking"] if reasoning_format(eng.tokenizer.chat_template) is not None else []),
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
        turn_request = to_turn_request(body, reasoning_of(body.think, served))
        turn = await start_client_turn(served.engine(), turn_request, request)
        return await answer(turn, body.stream, served.model_id, request, chat=True)

    @router.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request):
        served.check_model(body.model)
        if body.images:
            raise APIError(400, f"images: {IMAGES}", "images")
        if not body.prompt:  # loads the model: answer at once
            return Json(_done_line(served.model_id, "load", 0, 0, 0.0, chat=False))
        turn_request = to_turn_request(body, reasoning_of(body.think, served))
        turn = await start_client_turn(served.engine(), turn_request, request)
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
        done = await complete(turn, request)
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
    return {"function": {"name": call.name, "arguments": call.arguments_object()}}


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
                yield line({"error": generation_failed(event.error).message})
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
