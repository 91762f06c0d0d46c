"""The HTTP app over one engine: `create_app(engine)`, no module state. Each protocol is one
adapter module with its own routes (OpenAI chat and completions, OpenAI Responses, Anthropic
Messages, Ollama, utilities); this module adds the engine's own routes, auth, limits and the
error handlers, which answer in each route's own protocol's shape."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse

from lucedesk.engine import Engine
from lucedesk.server import (
    anthropic_api,
    errors,
    metrics,
    ollama_api,
    openai_api,
    responses_api,
    utility_api,
)
from lucedesk.server.errors import APIError
from lucedesk.server.served import Served

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
            return await self._reject(send, scope["path"])
        # The body is read here, at most `limit` bytes, and handed to the app whole; later
        # receive() calls (a disconnect) reach the server as usual.
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                return await self._reject(send, scope["path"])
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, send, path: str) -> None:
        error = APIError(413, f"request body larger than {self.limit} bytes")
        body = json.dumps(errors.body_for(errors.protocol_of(path), error)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def create_app(
    engine: Engine | Callable[[], Engine],
    *,
    model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_BODY_LIMIT,
    cors_origins: tuple[str, ...] = (),
) -> FastAPI:
    """`engine` may be a callable returning the current engine, for hosts (the TUI) that
    rebuild it while the app lives. `model_name` is one alias or several: the model answers
    to each, to its own id and to `default`; the first is the id clients are shown."""
    current = engine if callable(engine) and not isinstance(engine, Engine) else (lambda: engine)
    aliases = (model_name,) if isinstance(model_name, str) else tuple(model_name or ())
    served = Served(current, aliases)
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

    async def check_key(request: Request) -> None:
        """`Authorization: Bearer KEY` (OpenAI, Ollama) or `x-api-key: KEY` (Anthropic)."""
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        offered = [token.strip()] if scheme.lower() == "bearer" else []
        offered += request.headers.getlist("x-api-key")
        # Any credential that matches will do: Claude Code may send both headers at once.
        if not any(hmac.compare_digest(k.encode(), api_key.encode()) for k in offered):
            raise APIError(401, "missing or invalid API key", kind="authentication_error")

    auth = [Depends(check_key)]

    @app.get("/health")
    async def health() -> dict:
        eng = current()
        s = eng.stats()
        return {
            "status": "ok" if eng.running else "stopped",
            "model": served.model_id,
            "active": s.num_running,
            "queued": s.num_waiting,
            "completed": s.num_completed,
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        info = current().model_info
        entry = {
            "object": "model",
            "created": 0,
            "owned_by": "lucedesk",
            "context_length": info.context_length,
            "max_model_len": info.context_length,
            "file": info.path,
            "architecture": info.architecture,
            "quantization": info.quantization,
            "aliases": served.names()[1:],
        }
        return {"object": "list", "data": [{"id": served.model_id, **entry}]}

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
            "draft_tokens": s.draft_tokens,
            "accepted_draft_tokens": s.accepted_tokens,
            "slots": [asdict(slot) for slot in s.slots],
        }

    @app.get("/metrics", dependencies=auth)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(
            metrics.render(current().stats()), media_type="text/plain; version=0.0.4"
        )

    for adapter in (openai_api, responses_api, anthropic_api, ollama_api, utility_api):
        app.include_router(adapter.routes(served), dependencies=auth)
    return app
