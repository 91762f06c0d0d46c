"""What every protocol adapter sends a turn's reply with: ASCII-safe JSON, and a streamed
response that cancels its turn however the stream ends."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse, StreamingResponse

from lucedesk.chat import Turn

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj) -> str:
    """JSON for the wire: ASCII-escaped, so text that is not valid UTF-8 (a lone surrogate
    a client sent) can never break a response halfway."""
    return json.dumps(obj, ensure_ascii=True)


class Json(JSONResponse):
    def render(self, content) -> bytes:
        return dumps(content).encode()


class TurnStream(StreamingResponse):
    """A streamed reply that cancels its turn however the stream ends: the client left, or
    sending failed before the turn's own events began."""

    def __init__(self, turn: Turn, content, media_type: str = "text/event-stream") -> None:
        headers = SSE_HEADERS if media_type == "text/event-stream" else None
        super().__init__(content, media_type=media_type, headers=headers)
        self.turn = turn

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.turn.finished:
                self.turn.cancel()
