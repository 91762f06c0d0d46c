"""The HTTP app over one engine: `create_app(engine)`, no module state. Each protocol is one
adapter module with its own routes (OpenAI chat and completions, OpenAI Responses, Anthropic
Messages, Ollama, utilities); this module adds the engine's own routes, auth, limits and the
error handlers, which answer in each route's own protocol's shape."""

from __future__ import annotations

import asyncio
import fnmatch
import hmac
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from lucedesk.engine import Engine, EngineNotReady
from lucedesk.server import (
    anthropic_api,
    errors,
    metrics,
    ollama_api,
    openai_api,
    responses_api,
    utility_api,
)
from lucedesk.server.access import ERROR_BODY_LIMIT, AccessRecord
from lucedesk.server.errors import APIError
from lucedesk.server.served import CLIENT_HEADER, Served, label_of

DEFAULT_BODY_LIMIT = 4 << 20  # 4 MiB: a ~1M-character prompt, far beyond any context here
# A body past this (a long prompt): once answered, the memory its tokenization took is
# handed back to the system (glibc keeps freed memory in each thread's arena otherwise: RSS
# grew from 0.96 to 2.6 GB over four 3.9 MB prompts at a time, and stayed).
LARGE_BODY = 256 << 10


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Pages served from this machine (a local web UI on any port) may call the server.
LOOPBACK_ORIGIN = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$", re.I)
# A Host header: a DNS name or an IPv4 address, or an IPv6 one in brackets; then a port.
HOST_HEADER = re.compile(r"^(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::\d{1,5})?$", re.I)
CORS_METHODS = "GET, POST, DELETE, OPTIONS"


class Gate:
    """ASGI middleware in front of every route, before a body is read:

    - the Host header must name an allowed host (a loopback server answers only to its own
      names, so a web page that rebinds a domain to 127.0.0.1 cannot drive it), and be a
      well-formed one (`localhost:8642@evil.example` is not): else 403;
    - a request a browser sends from a web page carries its page's Origin: one not on this
      machine (nor allowed: `--allow-origin`) is refused, 403, on every route, so a page
      cannot drive the server with a "simple" request a browser sends unasked; an allowed
      origin's CORS preflight is answered (204) and its responses carry its CORS headers;
    - with an API key, every route but /health (the OpenAPI document included) needs it:
      `Authorization: Bearer KEY` or `x-api-key: KEY`: else 401;
    - a body over `limit` bytes is a 413, counted as it arrives (a Content-Length can be
      absent or wrong);
    - a body is JSON whatever its declared type (`curl -d` says form-urlencoded, and some
      clients send none), as Ollama takes it.
    Each refusal in the route's protocol's shape."""

    def __init__(
        self,
        app,
        limit: int,
        api_key: str | None,
        allowed_hosts: frozenset[str] | None,
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        self.app, self.limit, self.api_key, self.allowed_hosts = app, limit, api_key, allowed_hosts
        self.allowed_origins = tuple(o.lower().rstrip("/") for o in allowed_origins)

    def origin_allowed(self, origin: str) -> bool:
        """A page on this machine, or one `--allow-origin` names (`*` patterns match)."""
        if LOOPBACK_ORIGIN.match(origin):
            return True
        origin = origin.lower().rstrip("/")
        return any(fnmatch.fnmatchcase(origin, allowed) for allowed in self.allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        client = scope.get("client")
        record = AccessRecord(
            scope["method"],
            scope["path"],
            f"{client[0]}:{client[1]}" if client else "-",
            owner=label_of(
                headers.get(CLIENT_HEADER.encode(), b"").decode("latin-1") or None,
                headers.get(b"user-agent", b"").decode("latin-1") or None,
            ),
        )
        state = scope.setdefault("state", {})
        state["access"] = record  # request.state.access
        try:
            await self._gate(scope, receive, self._logged(send, record), headers)
        finally:
            record.finish()  # a client that left before its answer ended: logged now
            if state.get("large"):
                from lucedesk.engine import return_free_memory

                await asyncio.to_thread(return_free_memory)

    @staticmethod
    def _logged(send, record: AccessRecord):
        """`send` noting the answer's status, an error answer's body, and its end."""

        async def sending(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body":
                if (record.status or 0) >= 400 and len(record.body) < ERROR_BODY_LIMIT:
                    record.body += message.get("body", b"")[:ERROR_BODY_LIMIT]
                if not message.get("more_body", False):
                    await send(message)
                    record.finish()
                    return
            await send(message)

        return sending

    async def _gate(self, scope, receive, send, headers: dict):
        path = scope["path"]
        raw_host = headers.get(b"host", b"").decode("latin-1")
        host = host_name(raw_host)
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            said = host if host is not None else f"{raw_host!r}, not a well-formed Host,"
            error = APIError(
                403,
                f"host {said!r} is not allowed: this server answers to "
                f"{', '.join(sorted(self.allowed_hosts))} (lucedesk serve --allow-host NAME)",
                kind="permission_error",
            )
            return await self._refuse(send, path, error)
        origin = headers.get(b"origin")
        if origin is not None:
            origin_text = origin.decode("latin-1").strip()
            if not self.origin_allowed(origin_text):
                error = APIError(
                    403,
                    f"origin {origin_text!r} is not allowed: web pages from other sites cannot "
                    "call this server (lucedesk serve --allow-origin URL)",
                    kind="permission_error",
                )
                return await self._refuse(send, path, error)
            if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
                return await self._preflight(send, origin, headers)
            send = self._with_cors(send, origin)
        if self.api_key is not None and path != "/health" and not self._has_key(scope):
            error = APIError(401, "missing or invalid API key", kind="authentication_error")
            return await self._refuse(send, path, error)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, path, self._too_large())
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
                return await self._refuse(send, path, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if seen and b"json" not in headers.get(b"content-type", b"").lower():
            scope = dict(scope)
            scope["headers"] = [
                (k, v) for k, v in scope.get("headers") or [] if k != b"content-type"
            ] + [(b"content-type", b"application/json")]
        replayed = False
        if seen > LARGE_BODY:  # its tokenization's memory goes back to the system after it
            scope.setdefault("state", {})["large"] = True

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    def _has_key(self, scope) -> bool:
        """Any credential that matches will do: Claude Code may send both headers at once."""
        offered = []
        for name, value in scope.get("headers") or []:
            text = value.decode("latin-1")
            if name == b"authorization":
                scheme, _, token = text.partition(" ")
                if scheme.lower() == "bearer":
                    offered.append(token.strip())
            elif name == b"x-api-key":
                offered.append(text)
        key = self.api_key.encode()
        return any(hmac.compare_digest(k.encode("latin-1"), key) for k in offered)

    @staticmethod
    async def _preflight(send, origin: bytes, headers: dict) -> None:
        asked = headers.get(b"access-control-request-headers", b"*")
        await send(
            {
                "type": "http.response.start",
                "status": 204,
                "headers": [
                    (b"access-control-allow-origin", origin),
                    (b"access-control-allow-methods", CORS_METHODS.encode()),
                    (b"access-control-allow-headers", asked),
                    (b"access-control-max-age", b"600"),
                    (b"vary", b"Origin"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    def _with_cors(send, origin: bytes):
        """`send` with an allowed origin's CORS headers on the response."""

        async def sending(message):
            if message["type"] == "http.response.start":
                extra = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return sending

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.limit} bytes")

    async def _refuse(self, send, path: str, error: APIError) -> None:
        body = json.dumps(errors.body_for(errors.protocol_of(path), error)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def host_name(header: str) -> str | None:
    """The name in a Host header, port and IPv6 brackets off, lower case; None where the
    header is not a well-formed host[:port]."""
    match = HOST_HEADER.match(header.strip())
    if match is None:
        return None
    return (match["v6"] or match["name"]).lower()


def create_app(
    engine: Engine | Callable[[], Engine],
    *,
    model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_BODY_LIMIT,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
) -> FastAPI:
    """`engine` may be a callable returning the current engine, for hosts (the TUI) that
    rebuild it while the app lives. `model_name` is one alias or several: the model answers
    to each, to its own id and to `default`; the first is the id clients are shown.
    `allowed_hosts`: the Host names requests may carry (None: any, for a server other
    machines reach, which needs a key anyway). `allowed_origins`: web pages' origins that
    may call it besides this machine's (`*` patterns; `*` alone: any)."""
    current = engine if callable(engine) and not isinstance(engine, Engine) else (lambda: engine)
    aliases = (model_name,) if isinstance(model_name, str) else tuple(model_name or ())
    served = Served(current, aliases)
    app = FastAPI(title="lucedesk", version="1", docs_url=None, redoc_url=None)
    errors.install(app)
    hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
    app.add_middleware(
        Gate,
        limit=max_body_bytes,
        api_key=api_key,
        allowed_hosts=hosts,
        allowed_origins=tuple(allowed_origins),
    )

    @app.get("/health")
    async def health():
        try:
            eng = current()
        except EngineNotReady as exc:  # starting (building kernels, loading), or switching
            return JSONResponse({"status": "starting", "message": str(exc)}, status_code=503)
        s = eng.stats()
        return {
            "status": "ok" if eng.running else "stopped",
            "model": served.model_id,
            "active": s.num_running,
            "queued": s.num_waiting,
            "completed": s.num_completed,
        }

    @app.get("/v1/models")
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

    def slot_json(slot) -> dict:
        fields = asdict(slot)
        del fields["spans"], fields["progress_time"]  # what the rate and wait come from
        fields["tokens_per_s"] = round(slot.tokens_per_s, 2)
        wait = slot.wait_s
        fields["wait_s"] = None if wait is None else round(wait, 2)
        return fields

    @app.get("/slots")
    async def slots() -> dict:
        s = current().stats()
        return {
            "model": s.model,
            "step": s.step,
            "blocks_used": s.blocks_used,
            "blocks_total": s.blocks_total,
            "blocks_touched": s.blocks_touched,
            "block_size": s.block_size,
            "kv_block_bytes": s.kv_block_bytes,
            "pool_basis": s.pool_basis,
            "queued": s.num_waiting,
            "tokens_per_s": round(s.tokens_per_s, 2),
            "preemptions": s.num_preemptions,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "prefix_disk_hit_tokens": s.prefix_disk_hit_tokens,
            "draft_tokens": s.draft_tokens,
            "accepted_draft_tokens": s.accepted_tokens,
            "slots": [slot_json(slot) for slot in s.slots],
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(
            metrics.render(current().stats()), media_type="text/plain; version=0.0.4"
        )

    for adapter in (openai_api, responses_api, anthropic_api, ollama_api, utility_api):
        app.include_router(adapter.routes(served))
    return app
