"""Who says yes before an agent changes a file or runs a command. The TUI asks in a dialog,
the headless CLI on the terminal (or not at all: refused), and the user may allow edits or
commands for a whole session up front."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

Kind = Literal["edit", "command"]


@dataclass(slots=True, frozen=True)
class ApprovalRequest:
    kind: Kind
    session_title: str
    tool: str
    summary: str  # one line: "edit src/app.py", "run: pytest -q"
    detail: str  # the unified diff, or the command line


Ask = Callable[[ApprovalRequest], Awaitable[bool]]
# A /fanout split shown before its subagents start: the subtasks ({"title", "task"}) to run,
# edited or as they were, or None to run none.
ReviewSplit = Callable[[str, list[dict]], Awaitable[list[dict] | None]]


@dataclass(slots=True)
class Approvals:
    allow_edits: bool = False
    allow_commands: bool = False
    ask: Ask | None = None  # None: what is not allowed up front is refused
    review_split: ReviewSplit | None = None  # None: a /fanout split runs as the model wrote it

    def allowed(self, request: ApprovalRequest) -> bool:
        """Allowed up front: no one is asked."""
        return self.allow_edits if request.kind == "edit" else self.allow_commands

    async def approve(self, request: ApprovalRequest) -> bool:
        if self.allowed(request):
            return True
        if self.ask is None:
            return False
        return await self.ask(request)
