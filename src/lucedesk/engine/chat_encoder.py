"""Chats into prompts for one model: its tool format and reasoning format (read from its
chat template), the template rendered with the request's tools and reasoning switch, and
the grammar its reply must follow."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lucedesk.engine.grammar import Grammar, GrammarCompiler
from lucedesk.engine.harmony import HarmonyParser
from lucedesk.engine.messages import ChatMessage, Tool, ToolChoice, chat_messages
from lucedesk.engine.models.chat import render_chat
from lucedesk.engine.models.tokenizer import Tokenizer
from lucedesk.engine.reasoning import (
    ThinkSplitter,
    opens_reasoning,
    reasoning_format,
    reasoning_switch,
)
from lucedesk.engine.tool_calls import MARKERS, ToolFormat, detect_family
from lucedesk.engine.tool_parser import ToolCallParser
from lucedesk.errors import RequestError

# Reads a reply's text into text, reasoning and call events (feed/finish, calls).
ReplyParser = ToolCallParser | ThinkSplitter | HarmonyParser


@dataclass(slots=True, frozen=True)
class ChatPrompt:
    """A chat encoded for the engine: its tokens, the grammar its reply must follow (if
    any), the tool format to read calls back with (set when tools were offered), and how
    the model writes reasoning: "think" (tags, reasoning.py; `in_reasoning` when the prompt
    opened the tag), "harmony" (channels, harmony.py) or None."""

    token_ids: list[int]
    grammar: Grammar | None = None
    tool_format: ToolFormat | None = None
    tool_names: frozenset[str] = frozenset()
    reasoning: str | None = None
    in_reasoning: bool = False
    # Whole schemas the grammar holds only part of (json_schema.py), checked after the
    # reply: a tool's by its name, the answer's under None.
    strict: dict[str | None, object] = field(default_factory=dict)

    def parser(self) -> ReplyParser | None:
        """A fresh parser for the reply's reasoning and tool calls, or None when the reply
        is plain text."""
        if self.reasoning == "harmony":
            return HarmonyParser(self.tool_names if self.tool_format is not None else None)
        calls = self.tool_format.parser(self.tool_names) if self.tool_format else None
        if self.reasoning == "think":
            return ThinkSplitter(calls, self.in_reasoning)
        return calls


class ChatEncoder:
    def __init__(self, tokenizer: Tokenizer, grammars: GrammarCompiler) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.tool_format = ToolFormat(detect_family(tokenizer.chat_template))
        self.reasoning_format = reasoning_format(tokenizer.chat_template)
        # Tool-call markers the vocabulary holds as single tokens (grammars name them).
        self.single_token_markers = frozenset(
            m for m in MARKERS if tokenizer.token_to_id(m) is not None
        )

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
            schema = Grammar.json_schema(tool.parameters, f"tools[{i}]")
            self.grammars.check(schema)
            if schema.strict is not None:
                strict[tool.name] = tool.parameters
            held.append(Tool(tool.name, tool.description, json.loads(schema.source)))
        if response_format is not None:
            self.grammars.check(response_format)
            if response_format.strict is not None:
                strict[None] = json.loads(response_format.strict)
        fmt = self.tool_format if tools and choice.mode != "none" else None
        grammar = response_format
        # A harmony reply is channels whatever it holds: a format binds its final answer.
        if fmt is not None or (self.tool_format.family == "harmony" and response_format):
            text_schema = None
            if response_format is not None:
                if response_format.kind != "json_schema":
                    with_what = "tools" if fmt is not None else "this model's reply format"
                    raise RequestError(
                        f"a {response_format.kind} format cannot be combined with {with_what} "
                        "(a JSON schema can)",
                        response_format.field,
                    )
                text_schema = json.loads(response_format.source)
            grammar = self.tool_format.grammar(
                held if fmt is not None else [],
                choice,
                # a named function is called once: a second call of it could only repeat it
                parallel_tool_calls and choice.mode != "function",
                text_schema,
                self.single_token_markers,
            )
        text = render_prompt(
            self.tokenizer,
            chat_messages(messages),
            self.tool_format,
            tools,
            reasoning_switch(self.reasoning_format, reasoning),
            continue_final,
        )
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if grammar is not None:
            self.grammars.check(grammar)
        return ChatPrompt(
            token_ids,
            grammar,
            fmt,
            frozenset(t.name for t in tools),
            self.reasoning_format,
            self.reasoning_format == "think" and opens_reasoning(text),
            strict,
        )


def encode_chat(
    tokenizer: Tokenizer,
    messages: Iterable[ChatMessage | Mapping],
    tool_format: ToolFormat | None = None,
    tools: list[Tool] | None = None,
) -> list[int]:
    """Tokens of the prompt for `messages` (see `render_prompt`)."""
    text = render_prompt(tokenizer, chat_messages(messages), tool_format, tools)
    # The template writes any BOS itself, so the text is encoded without added specials.
    return tokenizer.encode(text, add_special_tokens=False)


def render_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    tool_format: ToolFormat | None = None,
    tools: list[Tool] | None = None,
    template_vars: dict | None = None,
    continue_final: bool = False,
) -> str:
    """The prompt text for `messages`; `tool_format` renders calls, results and reasoning
    and `tools` the model's way (needed whenever a message holds a call or a result).
    `continue_final`: the last message is an assistant reply cut short, and the prompt ends
    inside it, right after its text, so the model writes on (vLLM's
    continue_final_message)."""
    template_tools: list = []
    if tool_format is not None:
        shaped, template_tools = tool_format.render_messages(messages, tools or [])
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
