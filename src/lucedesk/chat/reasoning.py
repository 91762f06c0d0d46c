"""Reasoning apart from the answer for models that think in tags (Qwen3, QwQ, DeepSeek-R1
distills): `<think> ... </think>` at the start of a reply is reasoning, the rest the answer,
which a tool-call parser may read further. Templates that open the tag in the prompt
(the generation prompt ends in `<think>`) start the reply inside it.

Like the tool-call parser, fed text in any cut it gives the same events (joined) as for the
whole text; whitespace around the reasoning and before the answer is not content.

    <think>\\nThe user wants ...\\n</think>\\n\\nParis is the capital.
            └──── reasoning ────┘          └──── answer ────┘
"""

from __future__ import annotations

from lucedesk.chat.messages import ToolCall
from lucedesk.chat.tool_parser import ReasoningDelta, TextDelta, ToolCallParser, merge
from lucedesk.engine import overlap_with_start

OPEN, CLOSE = "<think>", "</think>"
LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the reply inside a reasoning block."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class ThinkSplitter:
    """Splits reasoning off a reply, then hands the answer to `inner` (a ToolCallParser) or
    passes it on as text. Has the parser's `calls` and `incomplete`."""

    def __init__(self, inner: ToolCallParser | None = None, inside: bool = False) -> None:
        self.inner = inner
        self._buffer = ""
        # start: a reply may open with the tag (spaces before it held); reasoning; gap:
        # whitespace after the close tag; answer.
        self._state = "reasoning" if inside else "start"
        self._reasoned = False  # some reasoning text was given out (leading spaces go)

    @property
    def calls(self) -> list[ToolCall]:
        return self.inner.calls if self.inner is not None else []

    @property
    def incomplete(self) -> bool:
        return self.inner is not None and self.inner.incomplete

    def feed(self, text: str) -> list:
        self._buffer += text
        events: list = []
        while self._step(events):
            pass
        return merge(events)

    def finish(self, cut: bool = False) -> list:
        events: list = []
        if self._state == "reasoning":
            events.append(ReasoningDelta(self._lead(self._buffer).rstrip()))
        elif self._state in ("start", "answer"):
            events += self._answer(self._buffer)
        self._buffer = ""
        if self.inner is not None:
            events += self.inner.finish(cut)
        return merge(events)

    def _lead(self, text: str) -> str:
        return text if self._reasoned else text.lstrip()

    def _answer(self, text: str) -> list:
        if self.inner is not None:
            return self.inner.feed(text)
        return [TextDelta(text)]

    def _step(self, events: list) -> bool:
        buf = self._buffer
        if self._state == "start":
            stripped = buf.lstrip()
            if not stripped:
                return False
            if stripped.startswith(OPEN):
                self._buffer, self._state = stripped[len(OPEN) :], "reasoning"
                return True
            if OPEN.startswith(stripped):
                return False
            self._state = "answer"
            return True
        if self._state == "reasoning":
            at = buf.find(CLOSE)
            if at < 0:  # hold a tail that may grow into the close tag, and trailing spaces
                head = buf[: len(buf) - overlap_with_start(buf, CLOSE)]
                skip = len(head) - len(self._lead(head))
                ready = head[skip:].rstrip()
                if ready:
                    events.append(ReasoningDelta(ready))
                    self._reasoned = True
                self._buffer = buf[skip + len(ready) :]
                return False
            ready = self._lead(buf[:at]).rstrip()
            if ready:
                events.append(ReasoningDelta(ready))
            self._buffer, self._state = buf[at + len(CLOSE) :], "gap"
            return True
        if self._state == "gap":
            stripped = buf.lstrip()
            if not stripped:
                self._buffer = ""
                return False
            self._buffer, self._state = stripped, "answer"
            return True
        events += self._answer(buf)
        self._buffer = ""
        return False
