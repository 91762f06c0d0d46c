"""What a tool is: a name, a description, a JSON schema for its arguments and an async
handler. A handler returns the text the model reads, or raises ToolError with a message the
model reads instead; the session goes on either way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from lucedesk.agent.tool_error import ToolError

if TYPE_CHECKING:
    from lucedesk.agent.approvals import ApprovalRequest, Approvals
    from lucedesk.agent.workspace import Workspace

# read: looks only (explore agents get these; they run in parallel with each other)
# write: changes files (asks first unless edits are allowed)
# exec: runs something (asks first unless commands are allowed)
# task: starts a child session
Access = Literal["read", "write", "exec", "task"]

MAX_RESULT_CHARS = 12_000  # what one tool result may put into the model's context

# The task tool's way to start a child: (description, prompt, agent type) -> its answer.
StartChild = Callable[[str, str, str], Awaitable[str]]


class Phased(Protocol):
    """What says a session's phase (an agent session): set while it waits for approval."""

    phase: str

    def set_phase(self, phase: str, status: str | None = None) -> None: ...


@dataclass(slots=True)
class ToolContext:
    """What a tool call gets: the workspace, the approvals, the title of the session that
    calls (shown with what it asks approval for), a way to start a child (the task tool's)
    and the session's phase (None where no session runs the tool)."""

    workspace: Workspace
    approvals: Approvals
    title: str
    start_child: StartChild | None = None
    phased: Phased | None = None

    async def approve(self, request: ApprovalRequest) -> bool:
        """The user's yes or no; meanwhile the session says it waits for it."""
        session = self.phased
        phase = session.phase if session is not None else None
        if session is not None and not self.approvals.allowed(request):
            session.set_phase("waiting for approval")
        try:
            return await self.approvals.approve(request)
        finally:
            if session is not None and phase is not None and session.phase != phase:
                session.set_phase(phase)


Handler = Callable[[ToolContext, dict], Awaitable[str]]


@dataclass(slots=True, frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments object
    handler: Handler
    access: Access = "read"


__all__ = ["MAX_RESULT_CHARS", "Access", "ToolContext", "ToolError", "ToolSpec", "capped", "schema"]


def schema(properties: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def capped(text: str, limit: int = MAX_RESULT_CHARS) -> str:
    """`text`, cut to `limit` characters with a note of how much was left out."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters not shown]"
