"""The harmony format's special tokens (gpt-oss's chat format): the loader shows the markers
as text in a reply, for the chat layer to parse (chat/formats/harmony.py), and stops on the ends."""

from __future__ import annotations

START, END, MESSAGE, CHANNEL, CONSTRAIN = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN)
ENDS = ("<|return|>", "<|call|>")  # what ends a reply: its answer, or a tool call


def is_harmony(template: str | None) -> bool:
    """A chat template of the harmony format."""
    return CHANNEL in (template or "")
