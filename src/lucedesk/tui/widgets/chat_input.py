"""The multi-line prompt input: Enter sends, Ctrl+J (or Shift+Enter) starts a new line."""

from __future__ import annotations

from textual import events
from textual.widgets import TextArea

from lucedesk.tui.messages import PromptSubmitted


class ChatInput(TextArea):
    DEFAULT_CSS = """
    ChatInput { height: auto; max-height: 8; min-height: 3; }
    """

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(PromptSubmitted(self.text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
