"""Chats into prompts for one model: its tool format and reasoning format (read from its
chat template), the template rendered with the request's tools and reasoning switch, and
the grammar its reply must follow."""

from __future__ import annotations

import json

from lucedesk.engine.grammar import Grammar, GrammarCompiler
from lucedesk.engine.models.chat import ChatPrompt, render_prompt
from lucedesk.engine.models.tokenizer import Tokenizer
from lucedesk.engine.reasoning import opens_reasoning, reasoning_format, reasoning_switch
from lucedesk.engine.tool_calls import MARKERS, Tool, ToolChoice, ToolFormat, detect_family
from lucedesk.errors import RequestError


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
        messages: list[dict],
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
                parallel_tool_calls,
                text_schema,
                self.single_token_markers,
            )
        text = render_prompt(
            self.tokenizer,
            messages,
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
