"""Chat prompts: the model's own Jinja chat template, rendered the way Hugging Face does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lucedesk.engine.models.tokenizer import Tokenizer
from lucedesk.errors import RequestError

if TYPE_CHECKING:
    from lucedesk.engine.grammar import Grammar
    from lucedesk.engine.harmony import HarmonyParser
    from lucedesk.engine.reasoning import ThinkSplitter
    from lucedesk.engine.tool_calls import Tool, ToolFormat
    from lucedesk.engine.tool_parser import ToolCallParser

    # Reads a reply's text into text, reasoning and call events (feed/finish, calls).
    ReplyParser = ToolCallParser | ThinkSplitter | HarmonyParser

# Used only when a model ships no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")


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
        from lucedesk.engine.harmony import HarmonyParser
        from lucedesk.engine.reasoning import ThinkSplitter

        if self.reasoning == "harmony":
            return HarmonyParser(self.tool_names if self.tool_format is not None else None)
        calls = self.tool_format.parser(self.tool_names) if self.tool_format else None
        if self.reasoning == "think":
            return ThinkSplitter(calls, self.in_reasoning)
        return calls


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, **kw) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list | None = None,
    template_vars: dict | None = None,
) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": str}, ...]); `tools` is
    handed to templates that render tools themselves, `template_vars` (enable_thinking,
    reasoning_effort) to templates that read them."""
    for i, message in enumerate(messages):
        if message.get("role") not in ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role"
            )
        if not isinstance(message.get("content"), str):
            raise RequestError(f"messages[{i}].content must be text", f"messages[{i}].content")
    template = _compile(tokenizer.chat_template or CHATML_TEMPLATE)

    def render(messages: list[dict]) -> str:
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            tools=tools or None,
            documents=None,
            **(template_vars or {}),
        )

    try:
        return render(messages)
    except jinja2.exceptions.TemplateError as exc:
        merged = merge_system(messages)
        if merged != messages:  # a template that takes one system message, and only first
            try:
                return render(merged)
            except jinja2.exceptions.TemplateError:
                pass
        raise RequestError(f"the model's chat template refused these messages: {exc}") from None


def merge_system(messages: list[dict]) -> list[dict]:
    """`messages` with every system message joined into one at the start (blank-line
    separated, in order): agents send instructions mid-conversation that templates written
    for one leading system message refuse."""
    system = [m["content"] for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    if not system:
        return messages
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    tool_format: ToolFormat | None = None,
    tools: list[Tool] | None = None,
) -> list[int]:
    """Tokens of the prompt for `messages` (see `render_prompt`)."""
    text = render_prompt(tokenizer, messages, tool_format, tools)
    # The template writes any BOS itself, so the text is encoded without added specials.
    return tokenizer.encode(text, add_special_tokens=False)


def render_prompt(
    tokenizer: Tokenizer,
    messages: list[dict],
    tool_format: ToolFormat | None = None,
    tools: list[Tool] | None = None,
    template_vars: dict | None = None,
    continue_final: bool = False,
) -> str:
    """The prompt text for `messages`, in the neutral shape of tool_calls.py where they
    carry tool calls, results or reasoning; `tool_format` renders those and `tools` the
    model's way (needed whenever a message holds a call or a result). `continue_final`:
    the last message is an assistant reply cut short, and the prompt ends inside it, right
    after its text, so the model writes on (vLLM's continue_final_message)."""
    template_tools: list = []
    if tool_format is not None:
        messages, template_tools = tool_format.render_messages(messages, tools or [])
    text = render_chat(
        tokenizer,
        messages,
        add_generation_prompt=not continue_final,
        tools=template_tools,
        template_vars=template_vars,
    )
    if not continue_final:
        return text
    final = messages[-1] if messages else {}
    content = final.get("content") or ""
    at = text.rfind(content) if content else -1
    if final.get("role") != "assistant" or at < 0:
        raise RequestError(
            "continuing the final message needs it to be an assistant reply with text the "
            "chat template keeps",
            f"messages[{len(messages) - 1}]",
        )
    return text[: at + len(content)]
