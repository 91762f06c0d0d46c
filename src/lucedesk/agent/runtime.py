"""What every session of one tree shares (the backend, the store, approvals, MCP tools, the
observer, the limits), and what a run of a session ends with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from lucedesk.agent.approvals import Approvals
from lucedesk.agent.compaction import Policy

if TYPE_CHECKING:
    from lucedesk.agent.backend import Backend
    from lucedesk.agent.events import AgentEvent, Observer, SessionView
    from lucedesk.agent.tools.base import ToolSpec
    from lucedesk.store import Store


@dataclass(slots=True)
class Limits:
    max_steps: int = 30  # model turns in one run of the loop
    max_depth: int = 2  # children of children of a top-level session, no deeper
    max_children: int = 8  # task calls of one turn that run (the rest get an error)
    compaction: Policy = field(default_factory=Policy)  # when and how a full context is compacted


@dataclass(slots=True)
class Runtime:
    """What every session of one tree shares."""

    backend: Backend
    store: Store
    approvals: Approvals = field(default_factory=Approvals)
    extra_tools: list[ToolSpec] = field(default_factory=list)  # MCP servers' tools
    observer: Observer | None = None
    limits: Limits = field(default_factory=Limits)
    # Whether someone watches a session now (the TUI: the one in the focused pane); its
    # model turns then keep their pace beside background work. None: nobody does.
    watched: Callable[[SessionView], bool] | None = None

    def emit(self, event: AgentEvent) -> None:
        if self.observer is not None:
            self.observer(event)


class AgentResult(NamedTuple):
    status: str  # done | step_limit | cancelled | error
    text: str
    error: str | None = None
