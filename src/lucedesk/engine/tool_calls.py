"""Tool calling, written once for every protocol: how a model family writes a call, the
grammar that holds it to that form, and how its chat template sees tools and results.

Four formats, chosen from the chat template's text:

  harmony  gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`
           after any reasoning, one call a reply (harmony.py)
  hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (Qwen2.5, Qwen3,
           Hermes and alike; the template renders `tools` and tool results itself)
  llama3   {"name": ..., "parameters": {...}}   the whole reply, calls joined by "; "
  generic  templates with no tool support (the default SmolLM2 model): the tools are described
           in the system message and calls use the hermes envelope, which the grammar enforces

Messages reach `render_messages` typed (messages.py); it hands the template the dicts it reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from lucedesk.engine import harmony
from lucedesk.engine.grammar import JSON_OPTIONS, Grammar
from lucedesk.engine.messages import ChatMessage, Tool, ToolCall, ToolChoice
from lucedesk.engine.tool_parser import ToolCallParser

Family = Literal["harmony", "hermes", "llama3", "generic"]
# Markers a vocabulary may hold as single tokens (then grammars name the token).
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def detect_family(template: str | None) -> Family:
    text = template or ""
    if "<|channel|>" in text:
        return "harmony"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ("tools" in text and '"parameters"' in text):
        return "llama3"
    return "generic"


GENERIC_INSTRUCTIONS = """\
You can call tools. The tools, with their arguments as JSON Schema:
{tools}

To call a tool, write
<tool_call>
{{"name": "<tool name>", "arguments": {{<the arguments as JSON>}}}}
</tool_call>
one block per call, and nothing after the blocks. Results come back in <tool_response> blocks.
When no tool is needed, answer in plain text."""


@dataclass(slots=True, frozen=True)
class ToolFormat:
    """One family's way of writing calls."""

    family: Family

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.family == "llama3" else "arguments"

    # -- prompt -----------------------------------------------------------------------------

    def render_messages(
        self, messages: list[ChatMessage], tools: list[Tool]
    ) -> tuple[list[dict], list]:
        """The messages and `tools` value to hand the chat template."""
        if self.family == "harmony":
            return harmony.render_messages(messages), [t.openai() for t in tools]
        if self.family != "generic":
            return [m.for_template() for m in messages], [t.openai() for t in tools]
        out: list[dict] = []
        results: dict | None = None  # the user turn collecting consecutive tool results
        for m in messages:
            if m.role == "tool":
                block = f"<tool_response>\n{m.content}\n</tool_response>"
                if results is None:
                    results = {"role": "user", "content": block}
                    out.append(results)
                else:
                    results["content"] += "\n" + block
                continue
            results = None
            if m.role == "assistant" and m.tool_calls:
                blocks = [_hermes_block(c) for c in m.tool_calls]
                text = "\n".join(([m.content] if m.content else []) + blocks)
                out.append(ChatMessage("assistant", text, reasoning=m.reasoning).for_template())
            else:
                out.append(m.for_template())
        if tools:
            listing = "\n".join(
                json.dumps(
                    {"name": t.name, "description": t.description, "parameters": t.parameters},
                    ensure_ascii=False,
                )
                for t in tools
            )
            note = GENERIC_INSTRUCTIONS.format(tools=listing)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out, []

    # -- grammar ----------------------------------------------------------------------------

    def grammar(
        self,
        tools: list[Tool],
        choice: ToolChoice,
        parallel: bool = True,
        text_schema: dict | bool | None = None,
        single_tokens: frozenset[str] = frozenset(),
    ) -> Grammar:
        """The Lark grammar for `choice` (`auto`, `required` or a function). Under `auto` free
        text stays free until the family's opening marker appears; from there the call must
        be well formed. A `text_schema` (a JSON response format) constrains the answer that
        is not a call. `single_tokens` names the markers the vocabulary holds as one token
        (Qwen's `<tool_call>`, `</tool_call>`, `<think>`, `</think>`): llguidance matches
        those as tokens, never as spelled-out text."""
        if self.family == "harmony":
            return harmony.grammar(tools, choice, text_schema)
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.function]
        schema = {"anyOf": [self._call_schema(i, t) for i, t in enumerate(offered)]}
        call_json = "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
        answer = None
        if text_schema is not None:
            answer = "%json " + json.dumps(
                {**text_schema, "x-guidance": JSON_OPTIONS}
                if isinstance(text_schema, dict)
                else text_schema
            )
        forced = choice.mode in ("required", "function")
        if self.family == "llama3":
            more = 'call_more: ("; " call_json)*' if parallel else "call_more: "
            rules = [
                "start: call_json call_more"
                if forced
                else f"start: {answer or 'TEXT'} | call_json call_more",
                more,
                f"call_json: {call_json}",
                # text is anything that does not open, after spaces, a call's brace
                r"TEXT: /(?s:.*)/ & ~/\s*\{(?s:.*)/",
            ]
        else:
            open_, close = (
                m if m in single_tokens else json.dumps(m) for m in ("<tool_call>", "</tool_call>")
            )
            more = f'call_more: ("\\n" {open_} call_body)*' if parallel else "call_more: "
            if forced:
                start = f"start: think {open_} call_body call_more"
            elif answer is not None:
                start = f"start: think ({answer} | {open_} call_body call_more)"
            elif "<tool_call>" in single_tokens:  # text, then the marker's own token
                start = f"start: think (TEXT | TEXT {open_} call_body call_more)"
            else:  # text up to the first spelled-out marker, which must open a call
                start = "start: think (TEXT | before_call call_body call_more)"
            rules = [
                start,
                more,
                f'call_body: "\\n" {call_json} "\\n" {close}',
                # free text never holds the marker, spelled out or as its token
                r"TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
                r"before_call[lazy]: /(?s:.*)<tool_call>/",
            ]
            if {"<think>", "</think>"} <= single_tokens:  # a reasoning block may come first
                rules += ["think: (<think> THINKING </think> /\\s*/)?", r"THINKING: /(?s:.*)/"]
            else:
                rules.append("think: ")
        field = "tools" if choice.mode != "function" else "tool_choice"
        return Grammar.lark("%llguidance {}\n" + "\n".join(rules), field)

    def _call_schema(self, index: int, tool: Tool) -> dict:
        # The tool's schema sits at #/anyOf/<index>/properties/<key>: its own "#..." refs
        # ($defs of nested pydantic models) are rebased to point there.
        at = f"#/anyOf/{index}/properties/{self.arguments_key}"
        return {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                self.arguments_key: _rebase_refs(tool.parameters, at),
            },
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }

    # -- output -----------------------------------------------------------------------------

    def parser(self, tool_names: frozenset[str] | None = None):
        """A parser for one reply; with `tool_names`, only envelopes naming one are calls."""
        if self.family == "harmony":
            return harmony.HarmonyParser(tool_names)
        if self.family == "llama3":
            return ToolCallParser(None, None, separator=";", tool_names=tool_names)
        return ToolCallParser("<tool_call>", "</tool_call>", tool_names=tool_names)


def _rebase_refs(schema, at: str):
    """`schema` with every local `$ref` ("#...") moved under the pointer `at`."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = at + value[1:]
            else:
                out[key] = _rebase_refs(value, at)
        return out
    if isinstance(schema, list):
        return [_rebase_refs(v, at) for v in schema]
    return schema


def _hermes_block(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments_value()}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
