"""What a turn asks for: a chat (or a raw prompt), the reply's format, how it is sampled,
and the protocol's names for errors. Each protocol's wire module builds one
(`to_turn_request`); agent sessions build theirs from the stored chat."""

from __future__ import annotations

from dataclasses import dataclass, field

from lucedesk.chat.messages import ChatMessage, Tool, ToolChoice, chat_messages
from lucedesk.engine import Grammar


@dataclass(slots=True)
class Sampling:
    """How a turn's reply is drawn; fields left None take the engine's defaults."""

    max_tokens: int | None = None  # an upper bound: capped to the room the prompt leaves
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculative: bool | None = None  # prompt-lookup drafts; None = the engine's default
    logprobs: int | None = None


@dataclass(slots=True)
class RawPrompt:
    """A raw completion's prompt: its tokens, or its text (tokenized with the turn)."""

    ids: list[int] | None = None
    text: str | None = None


@dataclass(slots=True)
class WireNames:
    """The protocol's own names, for errors: the field holding the prompt (named when it
    leaves no room), and its names for sampling fields ({"max_tokens": "max_output_tokens"})."""

    prompt: str = "messages"
    fields: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class TurnRequest:
    """A chat turn: messages, the tools offered and how the reply may use them; or, with
    `raw`, a raw completion of a prompt. Either way, the reply's format, how it is sampled,
    and the protocol's names for errors."""

    messages: list[ChatMessage] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    # How hard a reasoning model thinks: "none", "low", "medium", "high" (reasoning.LEVELS);
    # None: the model's default.
    reasoning: str | None = None
    # The last message is an assistant reply cut short: the model writes on from its text
    # (the result holds what comes after it).
    continue_final: bool = False
    raw: RawPrompt | None = None
    response_format: Grammar | None = None
    sampling: Sampling = field(default_factory=Sampling)
    names: WireNames = field(default_factory=WireNames)
    interactive: bool = False  # someone watches it (Engine.submit)

    def __post_init__(self) -> None:
        # In-process callers may write messages as plain dicts (messages.ChatMessage.parse).
        self.messages = chat_messages(self.messages)
