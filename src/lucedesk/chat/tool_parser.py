"""Turning a reply's text into content and tool calls as it streams.

Fed text deltas in any cut, the parser gives the same events (joined) as for the whole text:
text outside calls as `TextDelta`, and per call a `CallDelta` carrying its id and name once,
then the arguments in fragments that join to the JSON the model wrote. Envelopes look like

    [open marker] {"name": "get_weather", "arguments": {"city": "Paris"}} [close marker]
                                          ^ streamed from here ... to here ^

A call whose envelope is complete but not in that key order is parsed whole when it closes;
an envelope that is not JSON, has no name, or (given the offered tools) names none of them,
stays text. Whitespace right before a call is not content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from lucedesk.chat.messages import ToolCall
from lucedesk.engine import overlap_with_start

# The start of an envelope whose arguments can stream: name first, then the arguments key.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(slots=True, frozen=True)
class TextDelta:
    text: str


@dataclass(slots=True, frozen=True)
class ReasoningDelta:
    """Text the model wrote as reasoning (reasoning.py, harmony.py), apart from the answer."""

    text: str


@dataclass(slots=True, frozen=True)
class CallDelta:
    index: int
    id: str | None = None  # set on a call's first delta only
    name: str | None = None  # likewise
    arguments: str = ""


class _Envelope:
    """One call's JSON envelope, scanned character by character (strings and nesting
    tracked), so the arguments value can be streamed while it is still open."""

    def __init__(self) -> None:
        self.text = ""
        self.scanned = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self.name: str | None = None
        self.args_start: int | None = None  # where the arguments value begins in `text`
        self.args_end: int | None = None
        self.args_sent = 0  # characters of the arguments already handed out

    def feed(self, text: str) -> str:
        """Takes characters until the envelope closes; returns what follows it."""
        i = len(self.text)
        self.text += text
        while i < len(self.text) and not self.done:
            c = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
                if self.depth == 2 and self.name is None:
                    self._find_head(value_start=i)
            elif c in "}]":
                self.depth -= 1
                if self.args_start is not None and self.args_end is None and self.depth == 1:
                    self.args_end = i + 1
                self.done = self.depth == 0
            i += 1
        self.scanned = i
        rest = self.text[i:]
        self.text = self.text[:i]
        return rest

    def _find_head(self, value_start: int) -> None:
        m = _HEAD.fullmatch(self.text, 0, value_start)
        if m is None:
            return
        try:
            self.name = json.loads(f'"{m.group(1)}"')
        except json.JSONDecodeError:
            return
        self.args_start = value_start

    def arguments_so_far(self) -> str:
        """New characters of a streamable arguments value."""
        if self.args_start is None:
            return ""
        end = self.args_end if self.args_end is not None else self.scanned
        fresh = self.text[self.args_start + self.args_sent : end]
        self.args_sent += len(fresh)
        return fresh

    def parse(self) -> tuple[str, str] | None:
        """(name, arguments) of the closed envelope, or None if it is not a call."""
        try:
            obj = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if self.args_start is not None and self.args_end is not None:
            return obj["name"], self.text[self.args_start : self.args_end]
        args = obj.get("arguments", obj.get("parameters", {}))
        return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """Splits a reply into text and calls. With markers (hermes), calls sit between them
    anywhere in the text; without (llama3), a reply that starts with `{` is calls joined by
    `separator`, and any other reply is text."""

    def __init__(
        self,
        open_marker: str | None,
        close_marker: str | None,
        separator: str | None = None,
        tool_names: frozenset[str] | None = None,
    ) -> None:
        self.open_marker = open_marker
        self.close_marker = close_marker
        self.separator = separator
        self.tool_names = tool_names
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._state = "text" if open_marker else "start"
        self._envelope: _Envelope | None = None
        self._call: ToolCall | None = None  # the call being streamed
        self.incomplete = False  # the last call was cut off before its envelope closed
        self._closed = False  # after a call: its close marker was seen

    def feed(self, text: str) -> list[TextDelta | CallDelta]:
        self._buffer += text
        events: list[TextDelta | CallDelta] = []
        while self._step(events):
            pass
        return merge(events)

    def finish(self, cut: bool = False) -> list[TextDelta | CallDelta]:
        """Whatever is held back at the end. A cut-off call whose name is known stays a call
        (its arguments incomplete: `incomplete` says so); one cut off before its name is
        dropped: it was no text (its marker or opening brace already began a call). `cut`:
        max_tokens ended the reply, so a held-back start of the marker was a call begun,
        not text."""
        events: list[TextDelta | CallDelta] = []
        if self._envelope is not None and self._call is not None:
            self._stream_arguments(self._envelope, events)
            self.calls.append(self._call)
            self.incomplete = True
        elif self._state in ("text", "start"):
            held = self._buffer
            begun = overlap_with_start(held, self.open_marker) if cut and self.open_marker else 0
            events.append(TextDelta(held[: len(held) - begun].rstrip() if begun else held))
        self._buffer, self._envelope, self._call = "", None, None
        return merge(events)

    # -- the state machine: each step consumes what it can and says whether to go on --------

    def _step(self, events: list) -> bool:
        if self._state == "start":
            return self._step_start()
        if self._state == "text":
            return self._step_text(events)
        if self._state == "envelope":
            return self._step_envelope(events)
        return self._step_after()

    def _step_start(self) -> bool:
        """Marker-less formats: the first non-space character says call or text."""
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if stripped[0] == "{":
            self._buffer, self._state = stripped, "envelope"
        else:
            self._state = "text"
        return True

    def _step_text(self, events: list) -> bool:
        buf = self._buffer
        if self.open_marker is None:
            events.append(TextDelta(buf))
            self._buffer = ""
            return False
        at = buf.find(self.open_marker)
        if at < 0:  # hold back a tail that may grow into the marker, and spaces before it
            ready = buf[: len(buf) - overlap_with_start(buf, self.open_marker)]
            ready = ready[: len(ready.rstrip())]
            events.append(TextDelta(ready))
            self._buffer = buf[len(ready) :]
            return False
        events.append(TextDelta(buf[:at].rstrip()))
        self._buffer = buf[at + len(self.open_marker) :]
        self._state = "envelope"
        return True

    def _step_envelope(self, events: list) -> bool:
        if self._envelope is None:
            stripped = self._buffer.lstrip()
            if not stripped:
                return False
            if stripped[0] != "{":  # a marker not followed by JSON: it was text
                events.append(TextDelta((self.open_marker or "") + self._buffer))
                self._buffer, self._state = "", "text"
                return True
            self._envelope, self._buffer = _Envelope(), stripped
        env = self._envelope
        self._buffer = env.feed(self._buffer)
        self._stream_arguments(env, events)
        if not env.done:
            return False
        parsed = env.parse()
        if self._call is not None:  # announced already: a call however it ends
            self.calls.append(self._call)
        elif parsed is None or (self.tool_names is not None and parsed[0] not in self.tool_names):
            events.append(TextDelta((self.open_marker or "") + env.text))
        else:  # not streamable: the whole call at once
            call = ToolCall(ToolCall.new_id(), *parsed)
            events.append(CallDelta(len(self.calls), call.id, call.name, call.arguments))
            self.calls.append(call)
        self._envelope, self._call = None, None
        self._state, self._closed = "after", False
        return True

    def _stream_arguments(self, env: _Envelope, events: list) -> None:
        if env.name is None or (self.tool_names is not None and env.name not in self.tool_names):
            return
        if self._call is None:
            self._call = ToolCall(ToolCall.new_id(), env.name, "")
            events.append(CallDelta(len(self.calls), self._call.id, env.name))
        fresh = env.arguments_so_far()
        if fresh:
            self._call.arguments += fresh
            events.append(CallDelta(len(self.calls), arguments=fresh))

    def _step_after(self) -> bool:
        """After a call: its close marker, a separator, then more calls or text. Whitespace
        between calls is not content."""
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if self.close_marker and not self._closed:
            if stripped.startswith(self.close_marker):
                self._buffer, self._closed = stripped[len(self.close_marker) :], True
                return True
            if self.close_marker.startswith(stripped):
                return False
        if self.separator:
            if stripped.startswith(self.separator):
                self._buffer, self._state = stripped[len(self.separator) :], "start"
                return True
            if self.separator.startswith(stripped):
                return False
        self._buffer = stripped
        self._state = "start" if self.open_marker is None else "text"
        return True


def merge(events: list) -> list:
    """Adjacent text (or reasoning) deltas as one, empty ones dropped."""
    out: list = []
    for e in events:
        if isinstance(e, TextDelta | ReasoningDelta):
            if not e.text:
                continue
            if out and type(out[-1]) is type(e):
                out[-1] = type(e)(out[-1].text + e.text)
                continue
        out.append(e)
    return out


def parse_all(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """The whole reply at once: (content, calls)."""
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    return content, list(parser.calls)
