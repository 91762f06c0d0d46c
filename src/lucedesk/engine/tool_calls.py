"""Tool calling, written once for every protocol: how a model family writes a call, the
grammar that holds it to that form, and how its chat template sees tools and results.

Three formats, chosen from the chat template's text:

  hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (Qwen2.5, Qwen3,
           Hermes and alike; the template renders `tools` and tool results itself)
  llama3   {"name": ..., "parameters": {...}}   the whole reply, calls joined by "; "
  generic  templates with no tool support (the default SmolLM2 model): the tools are described
           in the system message and calls use the hermes envelope, which the grammar enforces

Messages reach `render_messages` in one neutral shape:
  {"role": "assistant", "content": str | None, "tool_calls": [ToolCall, ...]}
  {"role": "tool", "tool_call_id": str, "name": str, "content": str}
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal

from lucedesk.engine.grammar import JSON_OPTIONS, Grammar

Family = Literal["hermes", "llama3", "generic"]


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(slots=True)
class ToolCall:
    """A call the model made; `arguments` is JSON text exactly as the model wrote it."""

    id: str
    name: str
    arguments: str

    @staticmethod
    def new_id() -> str:
        return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True, frozen=True)
class ToolChoice:
    """`auto` (text or calls), `required` (at least one call), `none` (text only), or one
    named function that must be called."""

    mode: Literal["auto", "required", "none", "function"] = "auto"
    function: str | None = None


def detect_family(template: str | None) -> Family:
    text = template or ""
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

    def render_messages(self, messages: list[dict], tools: list[Tool]) -> tuple[list[dict], list]:
        """The messages and `tools` value to hand the chat template."""
        if self.family != "generic":
            native = [_native_message(m) for m in messages]
            return native, [_openai_tool(t) for t in tools]
        out: list[dict] = []
        results: dict | None = None  # the user turn collecting consecutive tool results
        for m in messages:
            if m["role"] == "tool":
                block = f"<tool_response>\n{m['content']}\n</tool_response>"
                if results is None:
                    results = {"role": "user", "content": block}
                    out.append(results)
                else:
                    results["content"] += "\n" + block
                continue
            results = None
            if m["role"] == "assistant" and m.get("tool_calls"):
                blocks = [_hermes_block(c) for c in m["tool_calls"]]
                text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
                out.append({"role": "assistant", "content": text})
            else:
                out.append(dict(m))
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
        text_schema: dict | None = None,
    ) -> Grammar | None:
        """The Lark grammar for `choice`: None where nothing is constrained (auto with free
        text, or none). Under `auto` free text stays free until the family's opening marker
        appears; from there the call must be well formed. A `text_schema` (a JSON response
        format) constrains the non-call answer too."""
        if choice.mode == "none":
            return Grammar.json_schema(text_schema) if text_schema is not None else None
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.function]
        schema = {"anyOf": [self._call_schema(t) for t in offered]}
        schema["x-guidance"] = JSON_OPTIONS
        call_json = "%json " + json.dumps(schema)
        forced = choice.mode in ("required", "function")
        if self.family == "llama3":
            more = 'call_more: ("; " call_json)*\n' if parallel else "call_more: \n"
            text = "%json " + json.dumps(text_schema) if text_schema else "TEXT"
            start = (
                "start: call_json call_more" if forced else f"start: {text} | call_json call_more"
            )
            rules = [
                start,
                more,
                f"call_json: {call_json}",
                r"TEXT: /([^{](.|\n)*)?/",
            ]
        else:
            more = 'call_more: ("\\n<tool_call>" call_body)*\n' if parallel else "call_more: \n"
            if forced:
                start = 'start: "<tool_call>" call_body call_more'
            elif text_schema is not None:
                start = (
                    f'start: %json {json.dumps(text_schema)} | "<tool_call>" call_body call_more'
                )
            else:
                start = "start: TEXT | before_call call_body call_more"
            rules = [
                start,
                more,
                f'call_body: "\\n" {call_json} "\\n</tool_call>"',
                r"TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
                r"before_call[lazy]: /(?s:.*)<tool_call>/",
            ]
        field = "tools" if choice.mode != "function" else "tool_choice"
        return Grammar.lark("%llguidance {}\n" + "\n".join(rules), field)

    def _call_schema(self, tool: Tool) -> dict:
        return {
            "type": "object",
            "properties": {"name": {"const": tool.name}, self.arguments_key: tool.parameters},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }

    # -- output -----------------------------------------------------------------------------

    def parser(self):
        from lucedesk.engine.tool_parser import ToolCallParser

        if self.family == "llama3":
            return ToolCallParser(open_marker=None, close_marker=None, separator=";")
        return ToolCallParser(open_marker="<tool_call>", close_marker="</tool_call>")


def _openai_tool(tool: Tool) -> dict:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


def _arguments_object(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _native_message(m: dict) -> dict:
    """A message as tool-aware templates expect it: calls as OpenAI function objects whose
    arguments are objects (templates `tojson` them), results with their call's id."""
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments_object(c.arguments)},
            }
            for c in m["tool_calls"]
        ]
        return {"role": "assistant", "content": m.get("content") or "", "tool_calls": calls}
    return dict(m)


def _hermes_block(call: ToolCall) -> str:
    body = json.dumps(
        {"name": call.name, "arguments": _arguments_object(call.arguments)}, ensure_ascii=False
    )
    return f"<tool_call>\n{body}\n</tool_call>"
