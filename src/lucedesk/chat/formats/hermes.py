"""Hermes calls (Qwen2.5, Qwen3, Hermes and alike): each call a JSON envelope in tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, after any text; the template renders `tools` and tool results itself.
Qwen3's `<think>` reasoning is the base's (base.py)."""

from __future__ import annotations

import json

from lucedesk.chat.formats.base import CallFormat, json_rule, lark
from lucedesk.chat.messages import Tool, ToolCall, ToolChoice
from lucedesk.chat.tool_parser import ToolCallParser
from lucedesk.engine import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Markers a vocabulary may hold as single tokens (then grammars name the token).
MARKERS = (OPEN, CLOSE, "<think>", "</think>")


class Hermes(CallFormat):
    name = "hermes"
    markers = MARKERS

    def detects(self, template: str) -> bool:
        return OPEN in template

    def grammar(
        self,
        tools: list[Tool],
        choice: ToolChoice,
        parallel: bool = True,
        text_schema: dict | bool | None = None,
        single_tokens: frozenset[str] = frozenset(),
    ) -> Grammar:
        answer = json_rule(text_schema) if text_schema is not None else None
        open_, close = (m if m in single_tokens else json.dumps(m) for m in (OPEN, CLOSE))
        more = f'call_more: ("\\n" {open_} call_body)*' if parallel else "call_more: "
        if choice.mode in ("required", "function"):
            start = f"start: think {open_} call_body call_more"
        elif answer is not None:
            start = f"start: think ({answer} | {open_} call_body call_more)"
        elif OPEN in single_tokens:  # text, then the marker's own token
            start = f"start: think (TEXT | TEXT {open_} call_body call_more)"
        else:  # text up to the first spelled-out marker, which must open a call
            start = "start: think (TEXT | before_call call_body call_more)"
        rules = [
            start,
            more,
            f'call_body: "\\n" {self.call_rule(tools, choice)} "\\n" {close}',
            # free text never holds the marker, spelled out or as its token
            r"TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
            r"before_call[lazy]: /(?s:.*)<tool_call>/",
        ]
        if {"<think>", "</think>"} <= single_tokens:  # a reasoning block may come first
            rules += ["think: (<think> THINKING </think> /\\s*/)?", r"THINKING: /(?s:.*)/"]
        else:
            rules.append("think: ")
        return lark(rules, choice)

    def parser(self, tool_names: frozenset[str] | None = None) -> ToolCallParser:
        return ToolCallParser(OPEN, CLOSE, tool_names=tool_names)


def block(call: ToolCall) -> str:
    """A call as a hermes block."""
    body = json.dumps({"name": call.name, "arguments": call.arguments_value()}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


FORMAT = Hermes()
