"""The chat, typed: what every protocol adapter converts its wire messages into, what agent
sessions keep and store, and what the chat encoder renders in the model's own format.

    ChatMessage("system", "Be brief.")
    ChatMessage("user", "What is in main.py?")
    ChatMessage("assistant", tool_calls=[ToolCall("call_1", "read_file", '{"path": "main.py"}')])
    ChatMessage("tool", "print('hi')", tool_call_id="call_1", name="read_file")
    ChatMessage("assistant", "It prints hi.", reasoning="The file has one line...")

A tool result answers a call made earlier in the same chat: `CallLedger` is that rule,
written once for every protocol. This module imports nothing else of lucedesk's but errors.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from lucedesk.errors import RequestError

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant", "tool")


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict:
        """The tool in OpenAI's chat shape (the `tools` a template or a server takes)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(slots=True, frozen=True)
class ToolChoice:
    """`auto` (text or calls), `required` (at least one call), `none` (text only), or one
    named function that must be called."""

    mode: Literal["auto", "required", "none", "function"] = "auto"
    function: str | None = None


@dataclass(slots=True)
class ToolCall:
    """A call the model made; `arguments` is JSON text exactly as the model wrote it."""

    id: str
    name: str
    arguments: str

    @staticmethod
    def new_id() -> str:
        return "call_" + uuid.uuid4().hex[:24]

    def to_dict(self) -> dict:
        """The plain shape sessions store (`from_dict` reads it back)."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @classmethod
    def from_dict(cls, d: Mapping) -> ToolCall:
        return cls(str(d["id"]), str(d["name"]), str(d["arguments"]))

    def arguments_value(self) -> object:
        """The arguments as the JSON value they spell, or their text as written when they
        spell none (a call cut short by max_tokens): what a chat template shows the model of
        its own call."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return self.arguments

    def arguments_object(self) -> dict:
        """The arguments as the JSON object a protocol's call carries (Anthropic's `input`,
        Ollama's `arguments`); `{}` for text that is not one."""
        value = self.arguments_value()
        return value if isinstance(value, dict) else {}

    def openai(self, *, parsed: bool = False) -> dict:
        """The call in OpenAI's chat shape; `parsed` gives the arguments as the value they
        spell, the way chat templates read them (they `tojson` it), instead of JSON text."""
        arguments = self.arguments_value() if parsed else self.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(slots=True)
class ChatMessage:
    """One message of a chat. `content` is text; an assistant message may carry calls and
    what the model reasoned before it; a tool message answers one call by its id."""

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""
    tool_call_id: str = ""  # role "tool": the call this answers
    name: str = ""  # role "tool": the called function's name

    @classmethod
    def parse(cls, raw: ChatMessage | Mapping, at: str) -> ChatMessage:
        """A message from the plain shape in-process callers write (the fields above as a
        dict, calls as ToolCall or {"id", "name", "arguments"}); raises RequestError naming
        `at` and the field that is wrong."""
        if isinstance(raw, ChatMessage):
            return raw
        if not isinstance(raw, Mapping):
            raise RequestError(f"{at} must be an object with role and content", at)
        role = raw.get("role")
        if role not in ROLES:
            raise RequestError(f"{at}.role must be one of {', '.join(ROLES)}", f"{at}.role")
        content = raw.get("content")
        if content is None and (role == "assistant" and raw.get("tool_calls")):
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"{at}.content must be text", f"{at}.content")
        calls = []
        for j, call in enumerate(raw.get("tool_calls") or []):
            if isinstance(call, Mapping):
                try:
                    call = ToolCall.from_dict(call)
                except KeyError as exc:
                    where = f"{at}.tool_calls[{j}].{exc.args[0]}"
                    raise RequestError(f"{where} is required", where) from None
            calls.append(call)
        return cls(
            role,
            content,
            calls,
            raw.get("reasoning") or "",
            raw.get("tool_call_id") or "",
            raw.get("name") or "",
        )

    def openai(self, *, parsed: bool = False) -> dict:
        """The message in OpenAI's chat shape, what a remote server takes: a result with
        its call's id, earlier reasoning as `reasoning_content` (the key llama.cpp, vLLM and
        lucedesk read back); `parsed`: call arguments as objects."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.openai(parsed=parsed) for c in self.tool_calls]
            if not self.content.strip():
                out["content"] = None  # calls alone: OpenAI's null content
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out

    def for_template(self) -> dict:
        """The message as tool-aware chat templates read it: OpenAI's shape with call
        arguments as values (templates `tojson` them), content always text, and a result's
        function name."""
        out = self.openai(parsed=True)
        out["content"] = self.content
        if self.role == "tool":
            out["name"] = self.name
        return out


def chat_messages(
    items: Iterable[ChatMessage | Mapping], at: str = "messages"
) -> list[ChatMessage]:
    """A chat as typed messages, whichever shape an in-process caller wrote it in."""
    return [ChatMessage.parse(m, f"{at}[{i}]") for i, m in enumerate(items)]


class CallLedger:
    """The calls a chat has made so far. A tool result must answer one of them: by its id
    (OpenAI, Responses, Anthropic) or, where calls carry no ids (Ollama), the earliest one
    still unanswered."""

    def __init__(self) -> None:
        self._calls: dict[str, ToolCall] = {}
        self._unanswered: list[ToolCall] = []

    def made(self, call: ToolCall, field: str | None = None) -> ToolCall:
        """Records `call`; with `field` (where a client sent the arguments as text) checks
        they are JSON, raising a RequestError naming the field."""
        if field is not None:
            try:
                json.loads(call.arguments)
            except (TypeError, json.JSONDecodeError):
                raise RequestError(f"{field} is not valid JSON", field) from None
        self._calls[call.id] = call
        self._unanswered.append(call)
        return call

    def answer(self, call_id: object, content: str, field: str, what: str) -> ChatMessage:
        """The tool message answering call `call_id`; a RequestError naming `field` when no
        earlier `what` (the protocol's word for a call) has that id."""
        call = self._calls.get(call_id) if isinstance(call_id, str) else None
        if call is None:
            raise RequestError(
                f"{field} {call_id!r} matches no {what} of an earlier message", field
            )
        if call in self._unanswered:
            self._unanswered.remove(call)
        return ChatMessage("tool", content, tool_call_id=call.id, name=call.name)

    def answer_next(self, name: str | None, content: str, field: str) -> ChatMessage:
        """The tool message answering the earliest unanswered call (of function `name`,
        when given)."""
        call = next((c for c in self._unanswered if name in (None, c.name)), None)
        if call is None:
            raise RequestError(
                f"{field} is a tool result but no earlier tool call awaits one", field
            )
        return self.answer(call.id, content, field, "tool call")
