"""What a tool is: a name, a description, a JSON schema for its arguments and an async
handler. A handler returns the text the model reads, or raises ToolError with a message the
model reads instead; the session goes on either way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from lucedesk.agent.tool_error import ToolError

if TYPE_CHECKING:
    from lucedesk.agent.approvals import ApprovalRequest, Approvals
    from lucedesk.agent.session import AgentSession
    from lucedesk.agent.workspace import Workspace

# read: looks only (explore agents get these; they run in parallel with each other)
# write: changes files (asks first unless edits are allowed)
# exec: runs something (asks first unless commands are allowed)
# task: starts a child session
Access = Literal["read", "write", "exec", "task"]

MAX_RESULT_CHARS = 12_000  # what one tool result may put into the model's context


@dataclass(slots=True)
class ToolContext:
    workspace: Workspace
    approvals: Approvals
    session: AgentSession

    async def approve(self, request: ApprovalRequest) -> bool:
        """The user's yes or no; meanwhile the session says it waits for it."""
        phase = getattr(self.session, "phase", None)
        set_phase = getattr(self.session, "set_phase", None)
        if set_phase is not None and not self.approvals.allowed(request):
            set_phase("waiting for approval")
        try:
            return await self.approvals.approve(request)
        finally:
            if set_phase is not None and phase is not None and self.session.phase != phase:
                set_phase(phase)


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
