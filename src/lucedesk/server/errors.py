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

from lucedesk.engine import QueueFullError, RequestError

log = logging.getLogger(__name__)

# Said of image, audio and document parts, in every protocol.
TEXT_ONLY = "the loaded model takes text only"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers


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
    if protocol == "anthropic":
        kind = ANTHROPIC_KINDS.get(exc.kind, exc.kind)
        return {"type": "error", "error": {"type": kind, "message": exc.message}}
    if protocol == "ollama":
        return {"error": exc.message}
    return error_body(exc.message, exc.kind, exc.param, str(exc.status))


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(
        body_for(protocol_of(path), exc), status_code=exc.status, headers=exc.headers
    )


def from_request_error(exc: RequestError) -> APIError:
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), kind="server_busy", headers={"Retry-After": "1"})
    return APIError(400, str(exc), exc.field)


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
