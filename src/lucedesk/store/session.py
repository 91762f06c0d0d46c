"""A stored session as the store hands it out: its settings and its messages (dicts with
"role", "content", "status", "meta" and "id"), and what the model and the reader see of
them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lucedesk.engine import ChatMessage, ToolCall


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
    # {"role", "content", "status", "meta", "id"}
    messages: list[dict] = field(default_factory=list)

    def chat_messages(self) -> list[ChatMessage]:
        """What the model sees: the system prompt, then the conversation (without a reply
        or tool call still being written)."""
        out = [ChatMessage("system", self.system_prompt)] if self.system_prompt else []
        for m in self.messages:
            if m.get("status") == "streaming":
                continue
            meta = m.get("meta") or {}
            if m["role"] == "tool":
                out.append(
                    ChatMessage(
                        "tool",
                        m["content"],
                        tool_call_id=meta.get("tool_call_id", ""),
                        name=meta.get("name", ""),
                    )
                )
            elif m["role"] == "assistant":  # the template decides what reasoning it shows
                calls = [ToolCall.from_dict(c) for c in meta.get("tool_calls") or []]
                out.append(ChatMessage("assistant", m["content"], calls, meta.get("reasoning", "")))
            else:  # a /fanout line: the model reads the prompt it stands for
                out.append(ChatMessage(m["role"], meta.get("prompt", m["content"])))
        return out


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
    return next((m["id"] for m in reversed(session.messages) if m["role"] == "user"), 0)


def message_notes(m: dict) -> list[str]:
    """How a stored message ended, when not plainly: interrupted (the process died), stopped
    (Esc), max tokens, or the error."""
    meta = m.get("meta") or {}
    if m.get("status") == "interrupted":
        return ["interrupted"]
    if meta.get("error"):
        return [f"error: {meta['error']}"]
    if meta.get("cut"):
        return ["max tokens"]
    if meta.get("stopped"):
        return ["stopped"]
    return []
