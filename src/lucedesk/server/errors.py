"""Errors, each answered in its route's own protocol's shape:

OpenAI (/v1/chat, /v1/completions, /v1/responses, the rest):
    {"error": {"message", "type", "param", "code"}}
Anthropic (/v1/messages): {"type": "error", "error": {"type", "message"}}
Ollama (/api/...): {"error": "message"}
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lucedesk.engine import ContextOverflow, QueueFullError, RequestError

log = logging.getLogger(__name__)

# Said of audio, document and other parts that are not text, in every protocol.
TEXT_ONLY = "the loaded model takes text only"
IMAGES = "images are not supported by the loaded model"
IMAGE_KINDS = frozenset({"image", "image_url", "input_image"})


def not_text(kind: str, what: str = "parts") -> str:
    """Why a part of this kind is refused: images by name, the rest as not text."""
    return IMAGES if kind in IMAGE_KINDS else f"{kind!r} {what}: {TEXT_ONLY}"


class APIError(Exception):
    """`messages` may give a protocol its own wording ({"anthropic": ..., "ollama": ...});
    `code` is OpenAI's error code (the status when None)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        code: str | None = None,
        messages: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers, self.code, self.messages = headers, code, messages or {}


def generation_failed(error: str | None) -> APIError:
    """The engine ended a turn with an error: the server's fault (500) in every protocol;
    streams that already answered 200 carry its message in their own error event."""
    return APIError(500, f"generation failed: {error}", kind="server_error")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ANTHROPIC_KINDS = {
    "server_error": "api_error",
    "server_busy": "overloaded_error",
}


def protocol_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def body_for(protocol: str, exc: APIError) -> dict:
    message = exc.messages.get(protocol, exc.message)
    if protocol == "anthropic":
        kind = ANTHROPIC_KINDS.get(exc.kind, exc.kind)
        return {"type": "error", "error": {"type": kind, "message": message}}
    if protocol == "ollama":
        return {"error": message}
    return error_body(message, exc.kind, exc.param, exc.code or str(exc.status))


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(
        body_for(protocol_of(path), exc), status_code=exc.status, headers=exc.headers
    )


def from_request_error(exc: RequestError) -> APIError:
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), kind="server_busy", headers={"Retry-After": "1"})
    if isinstance(exc, ContextOverflow):
        return context_overflow(exc)
    return APIError(400, str(exc), exc.field)


def context_overflow(exc: ContextOverflow) -> APIError:
    """A prompt the context cannot hold, in the words each protocol's clients look for to
    compact their history (OpenAI's code and sentence, Anthropic's "prompt is too long",
    Ollama's own)."""
    n, limit, what = exc.num_tokens, exc.limit, exc.field or "messages"
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your {what} "
        f"resulted in {n} tokens. Please reduce the length of the {what}.",
        exc.field,
        code="context_length_exceeded",
        messages={
            "anthropic": f"prompt is too long: {n} tokens > {limit - 1} maximum",
            "ollama": f"the input length exceeds the context length ({n} tokens, the "
            f"context holds {limit})",
        },
    )


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def field_path(loc) -> str | None:
    """pydantic's error location as a field path, `messages[0].content`: the body prefix
    and the tags naming which member of a union was tried (`str`, `list[TextPart]`) left
    out."""
    path = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        part = str(part)
        if "[" in part or part[:1].isupper() or part in _TYPE_TAGS or "-" in part:
            continue
        path += f".{part}" if path else part
    return path or None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestError)
    async def _request(request: Request, exc: RequestError):
        return error_response(from_request_error(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            error = APIError(400, f"malformed JSON body: {first.get('msg', '')}".rstrip(": "))
            return error_response(error, request.url.path)
        param = field_path(first.get("loc", ()))
        message = first.get("msg", "invalid request body")
        if param:
            message = f"{param}: {message}"
        return error_response(APIError(400, message, param), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(
            APIError(exc.status_code, str(exc.detail), kind=kind), request.url.path
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Logged with its traceback here; the client gets a message, never the traceback.
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        error = APIError(500, "internal server error", kind="server_error")
        return error_response(error, request.url.path)
