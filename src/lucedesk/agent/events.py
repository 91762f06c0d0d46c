"""What an agent session tells its observer (the TUI, the headless CLI) as it works. Every
event names its session; messages are the store's message dicts, already saved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lucedesk.agent.session import AgentSession


@dataclass(slots=True, frozen=True)
class PhaseChanged:
    """`session.phase` or `session.status` changed."""

    session: AgentSession


@dataclass(slots=True, frozen=True)
class MessageAdded:
    """A user message, a reply that starts streaming, or a tool call that starts."""

    session: AgentSession
    message: dict


@dataclass(slots=True, frozen=True)
class TextStreamed:
    """More text of a streaming reply (`message["content"]` already holds it)."""

    session: AgentSession
    message: dict
    text: str


@dataclass(slots=True, frozen=True)
class ReasoningStreamed:
    """More reasoning of a streaming reply (`message["meta"]["reasoning"]` holds it all)."""

    session: AgentSession
    message: dict
    text: str


@dataclass(slots=True, frozen=True)
class MessageDone:
    """A reply ended (its tool calls in `message["meta"]`) or a tool call has its result."""

    session: AgentSession
    message: dict


@dataclass(slots=True, frozen=True)
class ChildStarted:
    session: AgentSession  # the parent
    child: AgentSession


AgentEvent = (
    PhaseChanged | MessageAdded | TextStreamed | ReasoningStreamed | MessageDone | ChildStarted
)
Observer = Callable[[AgentEvent], None]
