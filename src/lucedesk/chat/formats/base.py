"""What a call format is: how one family of models writes tool calls and reasoning, read off
its chat template. Each format is a module beside this one (hermes.py, llama3.py,
harmony.py, generic.py) holding a `CallFormat` that owns, for its models,

  detection    whether a chat template is this format's (`detects`)
  rendering    the messages and tools as the template takes them (`render_messages`)
  grammar      the Lark grammar that holds a reply's calls to the format (`grammar`)
  parsing      a streaming parser reading calls back out of a reply (`parser`)
  reasoning    how the model reasons and how a request switches it (`reasoning`,
               `template_vars`), and the parser that splits it off (`reply_parser`)

The defaults here are those of models that reason in `<think>` tags, if at all."""

from __future__ import annotations

import json
from typing import Protocol

from lucedesk.chat.messages import ChatMessage, Tool, ToolCall, ToolChoice
from lucedesk.chat.reasoning import OPEN, ThinkSplitter
from lucedesk.engine import JSON_OPTIONS, Grammar


class ReplyParser(Protocol):
    """Reads a reply's text, fed in any cut, into text, reasoning and call events."""

    calls: list[ToolCall]
    incomplete: bool

    def feed(self, text: str) -> list: ...

    def finish(self, cut: bool = False) -> list: ...


class CallFormat:
    name: str = ""
    arguments_key = "arguments"  # the envelope's key for a call's arguments
    # Markers a vocabulary may hold as single tokens (its grammar then names the token).
    markers: tuple[str, ...] = ()
    # The answer itself sits in the format's envelope (harmony's final channel), so a
    # response format is held by the format's grammar even when no tools are offered.
    wraps_answer = False

    def detects(self, template: str) -> bool:
        """Whether `template` (a chat template's text) writes this format."""
        raise NotImplementedError

    def render_messages(
        self, messages: list[ChatMessage], tools: list[Tool]
    ) -> tuple[list[dict], list]:
        """The messages and `tools` value to hand the chat template."""
        return [m.for_template() for m in messages], [t.openai() for t in tools]

    def grammar(
        self,
        tools: list[Tool],
        choice: ToolChoice,
        parallel: bool = True,
        text_schema: dict | bool | None = None,
        single_tokens: frozenset[str] = frozenset(),
    ) -> Grammar:
        """The Lark grammar for `choice` (`auto`, `required` or a function): under `auto`
        free text stays free until the format's opening marker appears; from there the call
        must be well formed. A `text_schema` (a JSON response format) holds the answer that
        is not a call. `single_tokens`: those of `markers` the vocabulary holds as one
        token, which llguidance matches as tokens, never as spelled-out text."""
        raise NotImplementedError

    def parser(self, tool_names: frozenset[str] | None = None) -> ReplyParser:
        """A parser for one reply's calls; with `tool_names`, only envelopes naming one of
        them are calls."""
        raise NotImplementedError

    def call_rule(self, tools: list[Tool], choice: ToolChoice) -> str:
        """A Lark rule body holding one call's JSON envelope, to any tool `choice` offers."""
        calls = offered(tools, choice)
        return json_rule(
            {"anyOf": [call_schema(i, t, self.arguments_key) for i, t in enumerate(calls)]}
        )

    # -- reasoning ---------------------------------------------------------------------------

    def reasoning(self, template: str) -> str | None:
        """How the template's model reasons: "think" (tags, reasoning.py), "harmony"
        (channels), or None (it does not, as far as its template tells)."""
        return "think" if OPEN in template else None

    def template_vars(self, reasoning: str | None, level: str | None) -> dict:
        """The template variables that set a request's reasoning `level` (one of
        reasoning.LEVELS; None: the template's default), Qwen3's enable_thinking here."""
        if level is None or reasoning is None:
            return {}
        return {"enable_thinking": level != "none"}

    def reply_parser(
        self, tool_names: frozenset[str] | None, reasoning: str | None, inside: bool
    ) -> ReplyParser | None:
        """A fresh parser for a reply's reasoning and calls (None for `tool_names`: no calls
        are read), or None when the reply is plain text. `inside`: the prompt opened the
        reasoning block."""
        calls = self.parser(tool_names) if tool_names is not None else None
        if reasoning == "think":
            return ThinkSplitter(calls, inside)
        return calls


def offered(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools a reply may call under `choice`."""
    return [t for t in tools if choice.mode != "function" or t.name == choice.function]


def lark(rules: list[str], choice: ToolChoice) -> Grammar:
    """The grammar of `rules`, its errors naming the field the calls came from."""
    field = "tools" if choice.mode != "function" else "tool_choice"
    return Grammar.lark("%llguidance {}\n" + "\n".join(rules), field)


def json_rule(schema: dict | bool) -> str:
    """A Lark rule body holding JSON to `schema`, written the way models write JSON."""
    return "%json " + json.dumps(
        {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
    )


def call_schema(index: int, tool: Tool, arguments_key: str) -> dict:
    """The JSON envelope of a call to `tool`, the `index`-th alternative of an anyOf: its
    schema sits at #/anyOf/<index>/properties/<key>, where its own "#..." refs ($defs of
    nested pydantic models) are rebased to point."""
    at = f"#/anyOf/{index}/properties/{arguments_key}"
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            arguments_key: _rebase_refs(tool.parameters, at),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


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
