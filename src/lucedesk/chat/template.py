"""Chat prompts: the model's own Jinja chat template, rendered the way Hugging Face does."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lucedesk.engine import Tokenizer
from lucedesk.errors import RequestError

# Used only when a model ships no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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
    """The prompt text for `messages` (dicts as the template reads them: role, content and
    what messages.ChatMessage.for_template adds); `tools` is
    handed to templates that render tools themselves, `template_vars` (enable_thinking,
    reasoning_effort) to templates that read them."""
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
