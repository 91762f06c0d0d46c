"""Llama 3 calls: the whole reply is the calls, each a JSON object, joined by "; ",

    {"name": "get_weather", "parameters": {"city": "Paris"}}

or, with no call, plain text that does not open with a brace."""

from __future__ import annotations

from lucedesk.chat.formats.base import CallFormat, json_rule, lark
from lucedesk.chat.messages import Tool, ToolChoice
from lucedesk.chat.tool_parser import ToolCallParser
from lucedesk.engine import Grammar


class Llama3(CallFormat):
    name = "llama3"
    arguments_key = "parameters"

    def detects(self, template: str) -> bool:
        return "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template)

    def grammar(
        self,
        tools: list[Tool],
        choice: ToolChoice,
        parallel: bool = True,
        text_schema: dict | bool | None = None,
        single_tokens: frozenset[str] = frozenset(),
    ) -> Grammar:
        answer = json_rule(text_schema) if text_schema is not None else "TEXT"
        forced = choice.mode in ("required", "function")
        rules = [
            "start: call_json call_more" if forced else f"start: {answer} | call_json call_more",
            'call_more: ("; " call_json)*' if parallel else "call_more: ",
            f"call_json: {self.call_rule(tools, choice)}",
            # text is anything that does not open, after spaces, a call's brace
            r"TEXT: /(?s:.*)/ & ~/\s*\{(?s:.*)/",
        ]
        return lark(rules, choice)

    def parser(self, tool_names: frozenset[str] | None = None) -> ToolCallParser:
        return ToolCallParser(None, None, separator=";", tool_names=tool_names)


FORMAT = Llama3()
