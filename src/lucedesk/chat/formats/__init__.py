"""Call formats, one module each, and the registry that picks a model's from its chat
template. A format owns how its models write tool calls and reasoning (base.py):

  harmony  gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`
           after any reasoning, one call a reply
  hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (Qwen2.5, Qwen3,
           Hermes and alike; the template renders `tools` and tool results itself)
  llama3   {"name": ..., "parameters": {...}}   the whole reply, calls joined by "; "
  generic  templates with no tool support: the tools described in the system message, calls
           in the hermes envelope, which the grammar enforces

Adding one is a module holding its `FORMAT` and its line in `FORMATS`, in the order
templates are tested (the first that `detects` one wins; generic matches any).
"""

from __future__ import annotations

from lucedesk.chat.formats import generic, harmony, hermes, llama3
from lucedesk.chat.formats.base import CallFormat, ReplyParser

FORMATS: tuple[CallFormat, ...] = (
    harmony.FORMAT,
    hermes.FORMAT,
    llama3.FORMAT,
    generic.FORMAT,
)
BY_NAME = {f.name: f for f in FORMATS}


def format_of(template: str | None) -> CallFormat:
    """The call format a chat template writes."""
    return next(f for f in FORMATS if f.detects(template or ""))


def reasoning_format(template: str | None) -> str | None:
    """How a chat template's model reasons: "think", "harmony" or None."""
    return format_of(template).reasoning(template or "")


__all__ = ["BY_NAME", "FORMATS", "CallFormat", "ReplyParser", "format_of", "reasoning_format"]
