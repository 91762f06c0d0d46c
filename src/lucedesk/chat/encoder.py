"""Chats into prompts for one model: its call format (formats/, read from its chat
template), the template rendered with the request's tools and reasoning switch, and the
grammar its reply must follow."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from lucedesk.chat.formats import CallFormat, ReplyParser, format_of
from lucedesk.chat.json_schema import schema_grammar
from lucedesk.chat.messages import ChatMessage, Tool, ToolChoice, chat_messages
from lucedesk.chat.reasoning import opens_reasoning
from lucedesk.chat.template import render_chat
from lucedesk.engine import Engine, Grammar, Tokenizer
from lucedesk.errors import RequestError


@dataclass(slots=True, frozen=True)
class ChatPrompt:
    """A chat encoded for the engine: its tokens, the grammar its reply must follow (if
    any), the model's call format, the offered tools whose calls are read back (None when
    none are), and how the model writes reasoning: "think" (tags, reasoning.py;
    `in_reasoning` when the prompt opened the tag), "harmony" (channels) or None."""

    token_ids: list[int]
    grammar: Grammar | None = None
    format: CallFormat | None = None
    tool_names: frozenset[str] | None = None
    reasoning: str | None = None
    in_reasoning: bool = False
    # Whole schemas the grammar holds only part of (json_schema.py), checked after the
    # reply: a tool's by its name, the answer's under None.
    strict: dict[str | None, object] = field(default_factory=dict)

    def parser(self) -> ReplyParser | None:
        """A fresh parser for the reply's reasoning and tool calls, or None when the reply
        is plain text."""
        if self.format is None:
            return None
        return self.format.reply_parser(self.tool_names, self.reasoning, self.in_reasoning)


class ChatEncoder:
    """One model's chats into prompts. Cheap to build: the template compiles once per
    process (template.py), so a caller builds one where it needs one (`ChatEncoder.of`)."""

    def __init__(self, tokenizer: Tokenizer, check_grammar: Callable[[Grammar], None]) -> None:
        self.tokenizer = tokenizer
        self.check_grammar = check_grammar
        template = tokenizer.chat_template or ""
        self.format = format_of(template)
        self.reasoning = self.format.reasoning(template)
        # The format's markers the vocabulary holds as single tokens (grammars name them).
        self.single_token_markers = frozenset(
            m for m in self.format.markers if tokenizer.token_to_id(m) is not None
        )

    @classmethod
    def of(cls, engine: Engine) -> ChatEncoder:
        """The encoder for the model `engine` serves (grammars checked by the engine)."""
        return cls(engine.tokenizer, engine.check_grammar)

    def encode(
        self,
        messages: Iterable[ChatMessage | Mapping],
        tools: list[Tool] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool = True,
        response_format: Grammar | None = None,
        reasoning: str | None = None,
        continue_final: bool = False,
    ) -> ChatPrompt:
        """The prompt for a chat (tools rendered in the model's own format) and the grammar
        its reply must follow: the tool-call grammar for `tool_choice`, the response format,
        or both. `reasoning` ("none", "low", "medium", "high"; None: the model's default)
        sets the family's switch (enable_thinking, reasoning_effort). Raises RequestError
        naming the field of a tool or format that cannot be compiled, or a tool_choice
        naming no offered function."""
        tools = tools or []
        choice = tool_choice or ToolChoice()
        if choice.mode == "function" and choice.function not in {t.name for t in tools}:
            raise RequestError(
                f"tool_choice names {choice.function!r}, which is not among the tools",
                "tool_choice",
            )
        if choice.mode == "required" and not tools:
            raise RequestError("tool_choice 'required' needs at least one tool", "tool_choice")
        # The grammar holds what it can of each schema; the rest is checked afterwards.
        strict: dict[str | None, object] = {}
        held = []
        for i, tool in enumerate(tools):
            schema = schema_grammar(tool.parameters, f"tools[{i}]")
            self.check_grammar(schema)
            if schema.strict is not None:
                strict[tool.name] = tool.parameters
            held.append(Tool(tool.name, tool.description, json.loads(schema.source)))
        if response_format is not None:
            self.check_grammar(response_format)
            if response_format.strict is not None:
                strict[None] = json.loads(response_format.strict)
        calls = bool(tools) and choice.mode != "none"
        grammar = response_format
        if calls or (self.format.wraps_answer and response_format is not None):
            text_schema = None
            if response_format is not None:
                if response_format.kind != "json_schema":
                    with_what = "tools" if calls else "this model's reply format"
                    raise RequestError(
                        f"a {response_format.kind} format cannot be combined with {with_what} "
                        "(a JSON schema can)",
                        response_format.field,
                    )
                text_schema = json.loads(response_format.source)
            grammar = self.format.grammar(
                held if calls else [],
                choice,
                # a named function is called once: a second call of it could only repeat it
                parallel_tool_calls and choice.mode != "function",
                text_schema,
                self.single_token_markers,
            )
        text = render_prompt(
            self.tokenizer,
            chat_messages(messages),
            self.format,
            tools,
            self.format.template_vars(self.reasoning, reasoning),
            continue_final,
        )
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if grammar is not None:
            self.check_grammar(grammar)
        return ChatPrompt(
            token_ids,
            grammar,
            self.format,
            frozenset(t.name for t in tools) if calls else None,
            self.reasoning,
            self.reasoning == "think" and opens_reasoning(text),
            strict,
        )


def encode_chat(
    tokenizer: Tokenizer,
    messages: Iterable[ChatMessage | Mapping],
    call_format: CallFormat | None = None,
    tools: list[Tool] | None = None,
) -> list[int]:
    """Tokens of the prompt for `messages` (see `render_prompt`)."""
    text = render_prompt(tokenizer, chat_messages(messages), call_format, tools)
    # The template writes any BOS itself, so the text is encoded without added specials.
    return tokenizer.encode(text, add_special_tokens=False)


def render_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    call_format: CallFormat | None = None,
    tools: list[Tool] | None = None,
    template_vars: dict | None = None,
    continue_final: bool = False,
) -> str:
    """The prompt text for `messages`; `call_format` renders calls, results and reasoning
    and `tools` the model's way (needed whenever a message holds a call or a result).
    `continue_final`: the last message is an assistant reply cut short, and the prompt ends
    inside it, right after its text, so the model writes on (vLLM's
    continue_final_message)."""
    template_tools: list = []
    if call_format is not None:
        shaped, template_tools = call_format.render_messages(messages, tools or [])
    else:
        shaped = [m.for_template() for m in messages]
    text = render_chat(
        tokenizer,
        shaped,
        add_generation_prompt=not continue_final,
        tools=template_tools,
        template_vars=template_vars,
    )
    if not continue_final:
        return text
    final = shaped[-1] if shaped else {}
    content = final.get("content") or ""
    at = text.rfind(content) if content else -1
    if final.get("role") != "assistant" or at < 0:
        raise RequestError(
            "continuing the final message needs it to be an assistant reply with text the "
            "chat template keeps",
            f"messages[{len(messages) - 1}]",
        )
    return text[: at + len(content)]
