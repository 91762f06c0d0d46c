"""A reply's tool calls kept from repeating. A model forced to call (`required`, `any`) and
allowed parallel calls tends to write the same call again and again until its tokens run
out; a call identical to an earlier one of the same reply (same name, same arguments) is
dropped and ends the reply, which then ends as any reply with calls does.

While a call could still turn out to repeat an earlier one (its name is an earlier call's
and its arguments so far begin that call's), its stream deltas are held back; they go out
the moment it differs, so a new call streams with at most the length of the earlier one
held, and the first call of a reply is never held."""

from __future__ import annotations

import json

from lucedesk.chat.tool_parser import CallDelta


def same_arguments(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except json.JSONDecodeError:
        return a == b


class RepeatedCalls:
    def __init__(self, parser) -> None:
        self.parser = parser  # its `calls` are the reply's finished calls, in order
        self.names: dict[int, str | None] = {}
        self.arguments: dict[int, str] = {}
        self.held: dict[int, list[CallDelta]] = {}
        self.repeated = False  # a repeat was dropped: the reply ends here

    def filter(self, pieces: list) -> list:
        """`pieces` as they may go out now (see the module's docstring)."""
        out = []
        for piece in pieces:
            if not isinstance(piece, CallDelta) or self.repeated:
                if not isinstance(piece, CallDelta):
                    out.append(piece)
                continue
            i = piece.index
            if piece.name is not None:
                self.names[i] = piece.name
            self.arguments[i] = self.arguments.get(i, "") + piece.arguments
            if i in self.held or piece.id is not None:
                self.held.setdefault(i, []).append(piece)
                if not self._may_repeat(i):
                    out += self.held.pop(i)
                continue
            out.append(piece)
        for i in sorted(self.held):
            if len(self.parser.calls) > i:  # finished while held: it repeats an earlier one
                out += self._finished(i)
        calls = self.parser.calls
        if len(calls) > 1 and not self.repeated and self._repeats(len(calls) - 1):
            # Written otherwise (spaced), it went out before it could be told apart: it is
            # kept, and the reply still ends here.
            self.repeated = True
        return out

    def _repeats(self, i: int) -> bool:
        call = self.parser.calls[i]
        return any(
            c.name == call.name and same_arguments(c.arguments, call.arguments)
            for c in self.parser.calls[:i]
        )

    def _may_repeat(self, i: int) -> bool:
        name, so_far = self.names.get(i), self.arguments.get(i, "")
        return any(
            call.name == name and call.arguments.startswith(so_far)
            for call in self.parser.calls[:i]
        )

    def _finished(self, i: int) -> list[CallDelta]:
        if self._repeats(i):
            del self.parser.calls[i]
            del self.held[i]
            self.repeated = True
            return []
        return self.held.pop(i)
