"""A stored session as the store hands it out: its settings and its messages, and what the
model sees of them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lucedesk.chat import ChatMessage
from lucedesk.store.message import StoredMessage

SUMMARY_INTRO = (
    "The older messages of this conversation were compacted; your notes on them follow, "
    "and the conversation goes on after them."
)


@dataclass
class Session:
    id: int
    title: str
    system_prompt: str = ""
    temperature: float = 0.7
    max_tokens: int = 512
    kind: str = "chat"  # chat | subagent
    parent_id: int | None = None
    backend_url: str = ""  # "" = the in-process engine, else an OpenAI-compatible server
    status: str = "idle"
    agent_type: str = "chat"  # chat (no tools) | explore (read-only tools) | general
    workspace: str = ""
    messages: list[StoredMessage] = field(default_factory=list)

    def model_view(self) -> tuple[str, list[StoredMessage]]:
        """The summary of what the last compaction covers ("" when none), and the messages
        the model reads whole: those from where it cut (with the user message it kept in
        front), without a reply or tool call still being written."""
        shown = [m for m in self.messages if not m.streaming and m.role != "compaction"]
        marker = next((m for m in reversed(self.messages) if m.role == "compaction"), None)
        if marker is None:
            return "", shown
        kept = [m for m in shown if m.id >= marker.keep_from or m.id == marker.pinned]
        return marker.content, kept

    def chat_messages(self) -> list[ChatMessage]:
        """What the model sees: the system prompt (and the summary of what was compacted),
        then the conversation."""
        summary, messages = self.model_view()
        system = self.system_prompt
        if summary:
            system = f"{system}\n\n{SUMMARY_INTRO}\n{summary}".strip()
        out = [ChatMessage("system", system)] if system else []
        return out + [m.chat_message() for m in messages]


# The sessions table's columns a Session carries, in the order of its fields: a row selected
# with them is Session(*row).
SESSION_COLUMNS = tuple(f.name for f in fields(Session) if f.name != "messages")
# What a user changes in a session, all that update_session writes: not its id, kind or
# parent, which never change, nor its status, which set_status writes with its owner.
EDITABLE_COLUMNS = tuple(
    c for c in SESSION_COLUMNS if c not in ("id", "kind", "parent_id", "status")
)


def last_user_id(session: Session) -> int:
    """The id of the session's last user message (0 when there is none): what follows it is
    the reply a regenerate sets aside."""
    return next((m.id for m in reversed(session.messages) if m.role == "user"), 0)
