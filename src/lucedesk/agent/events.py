"""What an agent session tells its observer (the TUI, the headless CLI) as it works. Every
event names its session; messages are the store's, already saved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from lucedesk.store import StoredMessage

if TYPE_CHECKING:
    from lucedesk.store import Session


class SessionView(Protocol):
    """What an observer reads of the session an event names (session.py's SessionView)."""

    record: Session
    depth: int
    phase: str

    @property
    def id(self) -> int: ...

    @property
    def title(self) -> str: ...

    @property
    def parent(self) -> SessionView | None: ...


@dataclass(slots=True, frozen=True)
class PhaseChanged:
    """`session.phase` or `session.status` changed."""

    session: SessionView


@dataclass(slots=True, frozen=True)
class MessageAdded:
    """A user message, a reply that starts streaming, or a tool call that starts."""

    session: SessionView
    message: StoredMessage


@dataclass(slots=True, frozen=True)
class TextStreamed:
    """More text of a streaming reply (`message.content` already holds it)."""

    session: SessionView
    message: StoredMessage
    text: str


@dataclass(slots=True, frozen=True)
class ReasoningStreamed:
    """More reasoning of a streaming reply (`message.reasoning` holds it all)."""

    session: SessionView
    message: StoredMessage
    text: str


@dataclass(slots=True, frozen=True)
class MessageDone:
    """A reply ended (its tool calls in `message.tool_calls`) or a tool call has its result."""

    session: SessionView
    message: StoredMessage


@dataclass(slots=True, frozen=True)
class ChildStarted:
    session: SessionView  # the parent
    child: SessionView


AgentEvent = (
    PhaseChanged | MessageAdded | TextStreamed | ReasoningStreamed | MessageDone | ChildStarted
)
Observer = Callable[[AgentEvent], None]
