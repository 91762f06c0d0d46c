"""A stored message: one line of a session as the store keeps it and hands it out, to the
agent loop, its events, the TUI and the exports alike.

Beside role, text and status, a message holds what the model's view of it needs (a
ChatMessage: `chat_message`) and how it ended; the store writes those fields to the row's
`meta` column as JSON, leaving out the ones at their defaults."""

from __future__ import annotations

import json
from dataclasses import MISSING, Field, dataclass, field, fields

from lucedesk.chat import ChatMessage, ToolCall


@dataclass(eq=False)
class StoredMessage:
    role: str  # user | assistant | tool | compaction
    content: str = ""
    # done | streaming | interrupted (its process died) | aside<n>:<status> (set aside)
    status: str = "done"
    id: int = 0  # the row's id, set when the store adds it
    # An assistant reply's reasoning and calls, and how it ended: cut short by max tokens,
    # stopped by the user, or an error (a tool result's error: what went wrong).
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    cut: bool = False
    stopped: bool = False
    error: str = ""
    # A tool result: the call it answers, and that call's name and arguments.
    tool_call_id: str = ""
    name: str = ""
    arguments: str = ""
    # A /fanout line: the prompt the model reads for it; a /fanout split reply: the number
    # of subtasks its JSON holds (shown as progress while it streams).
    prompt: str = ""
    split: int = 0
    # A compaction (its content the summary): the first message the model still reads whole,
    # the user message kept in front of them when the cut fell inside its turn, how many
    # messages the summary stands for, and its length in tokens.
    keep_from: int = 0
    pinned: int = 0
    compacted: int = 0
    tokens: int = 0

    def meta(self) -> dict:
        """The fields kept in the row's `meta` column: those not at their defaults."""
        out: dict = {}
        for f in META_FIELDS:
            value = getattr(self, f.name)
            if value != _default(f):
                out[f.name] = [c.to_dict() for c in value] if f.name == "tool_calls" else value
        if self.role == "tool":  # a tool result says whether it failed, as a flag
            out["error"] = bool(self.error)
        return out

    @classmethod
    def from_row(
        cls, row_id: int, role: str, content: str, status: str, meta: str
    ) -> StoredMessage:
        kept = json.loads(meta or "{}")
        known = {f.name for f in META_FIELDS}
        values = {k: v for k, v in kept.items() if k in known}
        values["tool_calls"] = [ToolCall.from_dict(c) for c in values.get("tool_calls") or []]
        error = values.get("error")
        if not isinstance(error, str):  # a tool result's error was once true or false
            values["error"] = content if error else ""
        return cls(role, content, status, row_id, **values)

    def reset_meta(self) -> None:
        """Every meta field back to its default (a reply written on starts afresh)."""
        for f in META_FIELDS:
            setattr(self, f.name, _default(f))

    @property
    def streaming(self) -> bool:
        return self.status == "streaming"

    def notes(self) -> list[str]:
        """How the message ended, when not plainly: interrupted (the process died), the
        error, max tokens, or stopped (Esc)."""
        if self.status == "interrupted":
            return ["interrupted"]
        if self.error:
            return [f"error: {self.error}"]
        if self.cut:
            return ["max tokens"]
        if self.stopped:
            return ["stopped"]
        return []

    def chat_message(self) -> ChatMessage:
        """What the model sees of it (the template decides what reasoning it shows)."""
        if self.role == "tool":
            return ChatMessage("tool", self.content, tool_call_id=self.tool_call_id, name=self.name)
        if self.role == "assistant":
            return ChatMessage("assistant", self.content, list(self.tool_calls), self.reasoning)
        # a /fanout line: the model reads the prompt it stands for
        return ChatMessage(self.role, self.prompt or self.content)

    def to_json(self) -> dict:
        """The message as the headless agent's transcript writes it."""
        return {
            "role": self.role,
            "content": self.content,
            "status": self.status,
            "meta": self.meta(),
        }


META_FIELDS = tuple(fields(StoredMessage))[4:]


def _default(f: Field):
    return f.default if f.default_factory is MISSING else f.default_factory()
