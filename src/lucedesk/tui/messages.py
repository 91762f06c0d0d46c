"""Messages the TUI's widgets post to their screen."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from lucedesk.agent import AgentEvent


@dataclass
class PromptSubmitted(Message):
    """The user pressed Enter in a pane's input."""

    text: str


@dataclass
class SessionChosen(Message):
    """A session was picked in the sidebar: by a click (the focus stays there, for its own
    keys: r, Delete) or by Enter (typing goes on in the pane)."""

    session_id: int
    clicked: bool = False


@dataclass
class SessionRenameAsked(Message):
    """`r` on a session in the sidebar."""

    session_id: int


@dataclass
class SessionDeleteAsked(Message):
    """Delete on a session in the sidebar."""

    session_id: int


@dataclass
class SessionsChanged(Message):
    """A pane created or renamed a session: the sidebar lists them again."""


@dataclass
class AgentUpdate(Message):
    """An agent session (a pane's, or a child's) did something: see lucedesk.agent.events."""

    event: AgentEvent
