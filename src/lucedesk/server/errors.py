"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lucedesk.engine import QueueFullError, RequestError

log = logging.getLogger(__name__)


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


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.kind, exc.param, str(exc.status)),
        status_code=exc.status,
        headers=exc.headers,
    )


def from_request_error(exc: RequestError) -> APIError:
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), kind="server_busy", headers={"Retry-After": "1"})
    return APIError(400, str(exc), exc.field)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestError)
    async def _request(request: Request, exc: RequestError):
        return error_response(from_request_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request body")
        if param:
            message = f"{param}: {message}"
        return error_response(APIError(400, message, param))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Logged with its traceback here; the client gets a message, never the traceback.
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", kind="server_error"))
