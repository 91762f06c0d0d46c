"""Anthropic Messages' wire format: the request models and their conversion into a chat turn
(typed messages, tools, tool choice, reasoning and output format)."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lucedesk.chat import (
    CallLedger,
    ChatMessage,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
    TurnRequest,
    WireNames,
    schema_grammar,
)
from lucedesk.engine import Grammar, RequestError
from lucedesk.server.errors import TEXT_ONLY, not_text

log = logging.getLogger(__name__)


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class ThinkingBlock(BaseModel):
    """An earlier reply's reasoning, sent back (its signature, from lucedesk always empty,
    is not checked)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["redacted_thinking"]
    data: str = ""


class OtherBlock(BaseModel):
    """Blocks lucedesk does not serve (images, documents...): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


Block = (
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | OtherBlock
)


class Message(BaseModel):
    # A system entry inside `messages` (Claude Code sends them) is rendered where it stands
    # when the template allows, else joined to the leading system prompt.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoiceSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingSpec(BaseModel):
    """`thinking`: enabled (with a budget), disabled, or the model's own choice; `display:
    omitted` keeps the blocks and leaves their text out."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=0)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`output_config`: a JSON schema the reply's text must match (held by the grammar, as
    OpenAI's response_format is) and the effort, which sets the reasoning level."""

    model_config = ConfigDict(extra="allow")
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoiceSpec | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    thinking: ThinkingSpec | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None


def _result_text(block: ToolResultBlock) -> str:
    """A tool result's text. An image or document a tool returned (a screenshot, a PDF)
    becomes a note saying so: refusing it would leave the conversation unusable, since the
    client sends it again every turn."""
    if isinstance(block.content, str):
        return block.content
    parts = []
    for part in block.content:
        if part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            parts.append(f"[{part.get('type', 'a')} content omitted: {TEXT_ONLY}]")
    return "\n".join(parts)


def messages_of(body: MessagesRequest | CountTokensRequest) -> list[ChatMessage]:
    """The chat, typed; raises RequestError for blocks that are not served and for a
    tool_result whose tool_use_id matches no earlier tool_use."""
    out: list[ChatMessage] = []
    if body.system:
        system = (
            body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        )
        out.append(ChatMessage("system", system))
    ledger = CallLedger()
    for i, m in enumerate(body.messages):
        blocks = (
            [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        )
        text, calls, reasoning = [], [], []
        for j, block in enumerate(blocks):
            field = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ThinkingBlock | RedactedThinkingBlock) and m.role == "assistant":
                if isinstance(block, ThinkingBlock):  # redacted reasoning has no text to give
                    reasoning.append(block.thinking)
            elif isinstance(block, ToolUseBlock) and m.role == "assistant":
                calls.append(ledger.made(ToolCall(block.id, block.name, json.dumps(block.input))))
            elif isinstance(block, ToolResultBlock) and m.role == "user":
                content = _result_text(block)
                content = f"Error: {content}" if block.is_error else content
                out.append(
                    ledger.answer(block.tool_use_id, content, f"{field}.tool_use_id", "tool_use")
                )
            elif block.type == "text":
                raise RequestError(f"{field}.text is required in a text block", f"{field}.text")
            elif block.type in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
                raise RequestError(
                    f"{field}: a {block.type} block cannot be in a {m.role} turn", field
                )
            else:
                raise RequestError(f"{field}: {not_text(block.type, 'blocks')}", field)
        if m.role in ("system", "assistant"):
            out.append(ChatMessage(m.role, "".join(text), calls, "\n".join(reasoning)))
        elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append(ChatMessage("user", "".join(text)))
    return out


def tools_of(body: MessagesRequest | CountTokensRequest) -> list[Tool]:
    """The client's own tools. Anthropic's versioned tools (`web_search_20250305`,
    `bash_20250124`, `text_editor_...`) are run by Anthropic or defined by it without a
    schema: they are left out, with a log line, so a client that always sends them works."""
    tools = []
    for i, t in enumerate(body.tools or []):
        kind = getattr(t, "type", None)
        if kind not in (None, "custom"):
            log.info("messages: tools[%d] of type %r is not served here; left out", i, kind)
            continue
        tools.append(Tool(t.name, t.description or "", t.input_schema))
    return tools


def reasoning_of(spec: ThinkingSpec | None) -> str | None:
    """`thinking` as a reasoning level: a budget picks one (under 4k tokens low, under 16k
    medium, else high), disabled is none, adaptive and between_tools the model's default."""
    if spec is None or spec.type in ("adaptive", "between_tools"):
        return None
    if spec.type == "disabled":
        return "none"
    budget = spec.budget_tokens
    if budget is None:
        return "medium"
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


def to_turn_request(body: MessagesRequest) -> TurnRequest:
    choice, parallel = tool_choice_of(body.tool_choice)
    return TurnRequest(
        messages=messages_of(body),
        tools=tools_of(body),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        reasoning=effort_of(body),
        response_format=output_format_of(body),
        sampling=Sampling(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=tuple(body.stop_sequences or ()),
        ),
        names=WireNames(fields={"stop": "stop_sequences"}),
    )


def output_format_of(body: MessagesRequest) -> Grammar | None:
    if body.output_config is not None and body.output_config.format is not None:
        return schema_grammar(body.output_config.format.schema_, "output_config.format")
    if body.output_format is not None:
        return schema_grammar(body.output_format.schema_, "output_format")
    return None


def effort_of(body: MessagesRequest) -> str | None:
    """The reasoning level: `thinking` when sent, else `output_config.effort`."""
    if body.thinking is not None or body.output_config is None:
        return reasoning_of(body.thinking)
    effort = body.output_config.effort
    return None if effort is None else {"xhigh": "high", "max": "high"}.get(effort, effort)


def tool_choice_of(spec: ToolChoiceSpec | None) -> tuple[ToolChoice, bool]:
    """(the choice, whether parallel calls are allowed)."""
    if spec is None:
        return ToolChoice(), True
    parallel = not spec.disable_parallel_tool_use
    if spec.type == "tool":
        if not spec.name:
            raise RequestError(
                "tool_choice.name is required when type is 'tool'", "tool_choice.name"
            )
        return ToolChoice("function", spec.name), parallel
    return ToolChoice({"any": "required"}.get(spec.type, spec.type)), parallel
