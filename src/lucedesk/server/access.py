"""One line per request, so a person can see why a client failed: method, path, status,
client address, who sent it (its slot label), prompt and output tokens, time to first
token, duration, and for a 4xx or 5xx the message the client got.

    POST /v1/chat/completions 200 127.0.0.1:53112 http:claude-cli prompt=1204 output=57
        ttft=0.41s 2.93s
    POST /v1/messages 400 127.0.0.1:53140 http:claude-cli 0.02s: messages: the prompt ...

(each one line).

Lines go to the `lucedesk.access` logger at INFO (`lucedesk serve` prints them, the TUI keeps
them in its log view, F9); `JsonLines` writes each as a JSON object instead."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lucedesk.chat import Turn

log = logging.getLogger("lucedesk.access")
ERROR_BODY_LIMIT = 8192  # what is kept of an error answer to find its message in


@dataclass(slots=True)
class AccessRecord:
    method: str
    path: str
    client: str
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    owner: str = ""
    turn: Turn | None = None  # the chat turn the request started, for its tokens and TTFT
    body: bytearray = field(default_factory=bytearray)  # an error answer's first bytes
    done: bool = False

    def fields(self) -> dict:
        turn = self.turn
        ttft = None
        if turn is not None and turn.first_token_at is not None:
            ttft = round(turn.first_token_at - self.started, 3)
        return {
            "method": self.method,
            "path": self.path,
            "status": self.status if self.status is not None else 499,  # the client left
            "client": self.client,
            "owner": self.owner or None,
            "prompt_tokens": turn.num_prompt_tokens if turn is not None else None,
            "output_tokens": turn.num_output_tokens if turn is not None else None,
            "ttft_s": ttft,
            "duration_s": round(time.monotonic() - self.started, 3),
            "error": error_message(bytes(self.body)) if (self.status or 499) >= 400 else None,
        }

    def finish(self) -> None:
        """Logs the line, once: at the answer's last byte, or when the client left first."""
        if self.done:
            return
        self.done = True
        f = self.fields()
        level = logging.WARNING if f["status"] >= 500 else logging.INFO
        log.log(level, text_line(f), extra={"access": f})


def text_line(f: dict) -> str:
    parts = [f["method"], f["path"], str(f["status"]), f["client"]]
    if f["owner"]:
        parts.append(f["owner"])
    if f["prompt_tokens"] is not None:
        parts.append(f"prompt={f['prompt_tokens']} output={f['output_tokens']}")
    if f["ttft_s"] is not None:
        parts.append(f"ttft={f['ttft_s']:.2f}s")
    line = " ".join(parts) + f" {f['duration_s']:.2f}s"
    return line + (f": {f['error']}" if f["error"] else "")


def error_message(body: bytes) -> str:
    """The message in an error answer of any protocol's shape: {"error": {"message"}},
    {"error": "..."}, {"detail": ...}; else its text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300]
    if isinstance(data, dict):
        error = data.get("error", data.get("detail"))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:300]
    return str(data)[:300]


class JsonLines(logging.Formatter):
    """An access record as one JSON object (other records: time, level, logger, message)."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "access", None)
        if fields is not None:
            return json.dumps({"time": when, **fields}, ensure_ascii=False)
        return json.dumps(
            {
                "time": when,
                "level": record.levelname,
                "logger": record.name,
                "message": record.getMessage(),
            },
            ensure_ascii=False,
        )


def print_access(log_format: str = "text") -> None:
    """Access lines (and the rest of lucedesk's log at its level) printed on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonLines() if log_format == "json" else logging.Formatter("%(asctime)s %(message)s")
    )
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
