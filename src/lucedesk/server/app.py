"""The OpenAI-compatible app over one engine: `create_app(engine)`, no module state."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from lucedesk.engine import (
    Engine,
    FinishReason,
    Grammar,
    RequestError,
    RequestHandle,
    SamplingParams,
    ToolCallParser,
)
from lucedesk.server import errors, metrics
from lucedesk.server import openai_wire as wire
from lucedesk.server.errors import APIError
from lucedesk.server.openai_wire import ChatCompletionRequest, CompletionRequest, SamplingFields

CLIENT_HEADER = "x-lucedesk-client"
DEFAULT_BODY_LIMIT = 4 << 20  # 4 MiB: a ~1M-character prompt, far beyond any context here


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, counted as it arrives
    (a Content-Length can be absent or wrong)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        body = json.dumps(
            errors.error_body(
                f"request body larger than {self.limit} bytes", "invalid_request_error", None, "413"
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def owner_label(request: Request) -> str:
    """Who sent it, for the slot monitor: an explicit header, else the User-Agent's product."""
    label = request.headers.get(CLIENT_HEADER) or request.headers.get("user-agent") or "client"
    label = label.split()[0] if label.split() else "client"
    return "http:" + "".join(c for c in label if c.isprintable())[:32]


def create_app(
    engine: Engine | Callable[[], Engine],
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_BODY_LIMIT,
    cors_origins: tuple[str, ...] = (),
) -> FastAPI:
    """`engine` may be a callable returning the current engine, for hosts (the TUI) that
    rebuild it while the app lives."""
    current = engine if callable(engine) and not isinstance(engine, Engine) else (lambda: engine)
    app = FastAPI(title="lucedesk", version="1", docs_url=None, redoc_url=None)
    errors.install(app)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )

    def served_name() -> str:
        return model_name or current().model_name

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(401, "missing or invalid API key", kind="authentication_error")

    auth = [Depends(check_key)]

    @app.get("/health")
    async def health() -> dict:
        eng = current()
        s = eng.stats()
        return {
            "status": "ok" if eng.running else "stopped",
            "model": served_name(),
            "active": s.num_running,
            "queued": s.num_waiting,
            "completed": s.num_completed,
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {"id": served_name(), "object": "model", "created": 0, "owned_by": "lucedesk"}
            ],
        }

    @app.get("/slots", dependencies=auth)
    async def slots() -> dict:
        s = current().stats()
        return {
            "model": s.model,
            "step": s.step,
            "blocks_used": s.blocks_used,
            "blocks_total": s.blocks_total,
            "block_size": s.block_size,
            "queued": s.num_waiting,
            "tokens_per_s": round(s.tokens_per_s, 2),
            "preemptions": s.num_preemptions,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "slots": [asdict(slot) for slot in s.slots],
        }

    @app.get("/metrics", dependencies=auth)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(
            metrics.render(current().stats()), media_type="text/plain; version=0.0.4"
        )

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request):
        eng = current()
        check_common(body)
        try:
            prompt = eng.encode_chat(
                wire.messages_of(body),
                wire.tools_of(body),
                wire.tool_choice_of(body),
                body.parallel_tool_calls,
                wire.grammar_of(body.response_format),
            )
        except RequestError as exc:
            raise errors.from_request_error(exc) from None
        top = body.top_logprobs or 0
        call = Call(
            eng,
            body,
            request,
            chat=True,
            max_tokens=body.max_completion_tokens or body.max_tokens,
            grammar=prompt.grammar,
            logprobs=top if body.logprobs else None,
        )
        return await call.run(prompt.token_ids, prompt.parser())

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        eng = current()
        check_common(body)
        if isinstance(body.prompt, str):
            prompt = eng.tokenizer.encode(body.prompt)
        elif body.prompt and all(isinstance(p, str) for p in body.prompt):
            if len(body.prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            prompt = eng.tokenizer.encode(body.prompt[0])
        else:
            prompt = list(body.prompt)
        try:
            grammar = wire.grammar_of(body.response_format)
        except RequestError as exc:
            raise errors.from_request_error(exc) from None
        call = Call(
            eng,
            body,
            request,
            chat=False,
            max_tokens=body.max_tokens,
            grammar=grammar,
            logprobs=body.logprobs,
        )
        return await call.run(prompt, None)

    def check_common(body: SamplingFields) -> None:
        if body.model is not None and body.model != served_name():
            raise APIError(
                400, f"unknown model {body.model!r}; this server serves {served_name()!r}", "model"
            )
        if body.n != 1:
            raise APIError(400, "n must be 1", "n")

    class Call:
        """One completion request, from engine submission to the response or stream."""

        def __init__(
            self,
            eng: Engine,
            body: SamplingFields,
            request: Request,
            chat: bool,
            max_tokens: int | None,
            grammar: Grammar | None,
            logprobs: int | None,
        ) -> None:
            self.eng, self.body, self.request, self.chat = eng, body, request, chat
            self.max_tokens, self.grammar, self.logprobs = max_tokens, grammar, logprobs
            self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            self.created = int(time.time())
            self.model = served_name()
            self.format_logprobs = wire.LogprobFormatter(eng)

        async def run(self, prompt: list[int], parser: ToolCallParser | None):
            eng, body = self.eng, self.body
            stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
            try:
                params = SamplingParams(
                    max_tokens=eng.output_room(
                        len(prompt), self.max_tokens, "messages" if self.chat else "prompt"
                    ),
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=body.top_k or 0,
                    min_p=body.min_p or 0.0,
                    seed=body.seed,
                    stop=tuple(stop),
                    ignore_eos=body.ignore_eos,
                    grammar=self.grammar,
                    logprobs=self.logprobs,
                )
                handle = eng.submit(prompt, params, owner=owner_label(self.request))
            except RequestError as exc:
                raise errors.from_request_error(exc) from None
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(
                    self.stream(handle, parser, include_usage),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            done = await wait_or_cancel(eng, handle, self.request)
            if done.finish_reason is FinishReason.ERROR:
                raise APIError(500, f"generation failed: {done.error}", kind="server_error")
            if self.chat:
                message, called = wire.reply_message(done.text, parser)
                choice = {
                    "index": 0,
                    "message": message,
                    "finish_reason": wire.finish_reason(done.finish_reason, called),
                    "logprobs": self.format_logprobs.chat(done.logprobs)
                    if self.logprobs is not None
                    else None,
                }
            else:
                choice = {
                    "index": 0,
                    "text": done.text,
                    "finish_reason": wire.finish_reason(done.finish_reason),
                    "logprobs": self.format_logprobs.completion(done.logprobs)
                    if self.logprobs is not None
                    else None,
                }
            return JSONResponse(
                {
                    "id": self.rid,
                    "object": "chat.completion" if self.chat else "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [choice],
                    "usage": wire.usage(done.num_prompt_tokens, done.num_output_tokens),
                }
            )

        def event(self, choice: dict | None, usage: dict | None = None) -> str:
            payload = {
                "id": self.rid,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice] if choice else [],
            }
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        def piece(self, delta: dict, logprobs: tuple, reason: str | None = None) -> dict:
            lp = None
            if self.logprobs is not None and logprobs:
                lp = (
                    self.format_logprobs.chat(logprobs)
                    if self.chat
                    else self.format_logprobs.completion(logprobs)
                )
            if self.chat:
                return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": lp}
            return {
                "index": 0,
                "text": delta.get("content", ""),
                "finish_reason": reason,
                "logprobs": lp,
            }

        async def stream(
            self, handle: RequestHandle, parser: ToolCallParser | None, include_usage: bool
        ) -> AsyncIterator[str]:
            finished = False
            try:
                if self.chat:
                    yield self.event(self.piece({"role": "assistant", "content": ""}, ()))
                async for out in handle:
                    events = parser.feed(out.text) if parser is not None else []
                    if out.finished and parser is not None:
                        events += parser.finish()
                    delta = (
                        wire.delta_of(events)
                        if parser is not None
                        else ({"content": out.text} if out.text else {})
                    )
                    if delta or (out.logprobs and self.logprobs is not None):
                        yield self.event(self.piece(delta, out.logprobs))
                    if not out.finished:
                        continue
                    finished = True
                    if out.finish_reason is FinishReason.ERROR:
                        body = errors.error_body(
                            f"generation failed: {out.error}", "server_error", None, "500"
                        )
                        yield f"data: {json.dumps(body)}\n\n"
                    else:
                        called = parser is not None and bool(parser.calls)
                        reason = wire.finish_reason(out.finish_reason, called)
                        yield self.event(self.piece({}, (), reason))
                    if include_usage:
                        yield self.event(
                            None, wire.usage(out.num_prompt_tokens, out.num_output_tokens)
                        )
                yield "data: [DONE]\n\n"
            finally:
                # A client that disconnects cancels its request: slot and blocks come back at
                # the next step boundary.
                if not finished:
                    self.eng.cancel(handle.request_id)

    async def wait_or_cancel(eng: Engine, handle: RequestHandle, request: Request):
        """The whole completion; cancels the request if the client goes away first."""
        result = asyncio.ensure_future(handle.aresult())
        try:
            while not result.done():
                await asyncio.wait({result}, timeout=0.5)
                if not result.done() and await request.is_disconnected():
                    eng.cancel(handle.request_id)
            return result.result()
        finally:
            if not result.done():
                eng.cancel(handle.request_id)
                result.cancel()

    return app
