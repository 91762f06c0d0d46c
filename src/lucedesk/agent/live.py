"""An agent session as the parts that run its tool calls and its children see it
(tool_runner.py, children.py): what they read and call of it, nothing of how its loop runs.
session.py's AgentSession is the one there is; these parts sit below it, so they name it by
this protocol."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lucedesk.agent.runtime import AgentResult, Runtime
    from lucedesk.agent.tools.base import ToolSpec
    from lucedesk.agent.workspace import Workspace
    from lucedesk.chat import ToolChoice, TurnResult
    from lucedesk.engine import Grammar
    from lucedesk.store import Session, Store, StoredMessage


class LiveSession(Protocol):
    record: Session
    runtime: Runtime
    depth: int
    phase: str

    @property
    def id(self) -> int: ...

    @property
    def title(self) -> str: ...

    @property
    def store(self) -> Store: ...

    @property
    def workspace(self) -> Workspace | None: ...

    @property
    def cancelled(self) -> bool: ...

    def tools(self) -> list[ToolSpec]: ...

    def set_phase(self, phase: str, status: str | None = None) -> None: ...

    async def model_turn(
        self,
        choice: ToolChoice,
        tools_on: bool = True,
        response_format: Grammar | None = None,
        max_tokens: int | None = None,
        continued: StoredMessage | None = None,
        split: int = 0,
    ) -> TurnResult: ...

    async def guarded(self, work: Callable[[], Awaitable[AgentResult]]) -> AgentResult: ...

    async def run_child(self, description: str, prompt: str, agent_type: str) -> str: ...

    def adopt(self, record: Session) -> LiveSession: ...

    async def send(self, text: str) -> AgentResult: ...
