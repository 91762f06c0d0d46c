"""Chat prompts: the model's own Jinja chat template, rendered the way Hugging Face does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lucedesk.engine.models.tokenizer import Tokenizer
from lucedesk.errors import RequestError

if TYPE_CHECKING:
    from lucedesk.engine.grammar import Grammar
    from lucedesk.engine.tool_calls import Tool, ToolFormat
    from lucedesk.engine.tool_parser import ToolCallParser

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
    any), and the tool format to read calls back with (set when tools were offered)."""

    token_ids: list[int]
    grammar: Grammar | None = None
    tool_format: ToolFormat | None = None
    tool_names: frozenset[str] = frozenset()

    def parser(self) -> ToolCallParser | None:
        """A fresh parser for the reply's tool calls, or None when no tools were offered."""
        if self.tool_format is None:
            return None
        return self.tool_format.parser(self.tool_names)


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
) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": str}, ...]); `tools` is
    handed to templates that render tools themselves."""
    for i, message in enumerate(messages):
        if message.get("role") not in ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role"
            )
        if not isinstance(message.get("content"), str):
            raise RequestError(f"messages[{i}].content must be text", f"messages[{i}].content")
    template = _compile(tokenizer.chat_template or CHATML_TEMPLATE)
    try:
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            tools=tools or None,
            documents=None,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise RequestError(f"the model's chat template refused these messages: {exc}") from None


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    tool_format: ToolFormat | None = None,
    tools: list[Tool] | None = None,
) -> list[int]:
    """Tokens of the prompt for `messages`, in the neutral shape of tool_calls.py where
    they carry tool calls or results; `tool_format` renders those and `tools` the model's
    way (needed whenever a message holds a call or a result)."""
    template_tools: list = []
    if tool_format is not None:
        messages, template_tools = tool_format.render_messages(messages, tools or [])
    # The template writes any BOS itself, so the text is encoded without added specials.
    text = render_chat(tokenizer, messages, tools=template_tools)
    return tokenizer.encode(text, add_special_tokens=False)
