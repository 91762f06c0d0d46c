"""The multi-line prompt input: Enter sends, Ctrl+J (or Shift+Enter) starts a new line. A
paste of more than FOLD_LINES lines shows as one line, `[pasted 2,000 lines · 44,208 tokens]`,
and is sent whole; Ctrl+O unfolds the pastes into the text to edit them."""

from __future__ import annotations

from collections.abc import Callable

from textual import events
from textual.binding import Binding

from lucedesk.tui.messages import PromptSubmitted
from lucedesk.tui.widgets.text_area import TextArea

FOLD_LINES = 12  # a paste of more lines is folded into one


class ChatInput(TextArea):
    DEFAULT_CSS = """
    ChatInput { height: auto; max-height: 8; min-height: 3; }
    """
    BINDINGS = [Binding("ctrl+o", "unfold", "Unfold pastes", show=False)]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pastes: dict[str, str] = {}  # each folded paste's line in the text: the paste
        # The tokens of a text, where the pane's model can count them (None: not shown).
        self.count_tokens: Callable[[str], int | None] = lambda text: None

    @property
    def whole_text(self) -> str:
        """The text as it is sent: every folded paste in full."""
        text = self.text
        for line, paste in self.pastes.items():
            text = text.replace(line, paste)
        return text

    def clear(self):
        self.pastes.clear()
        return super().clear()

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(PromptSubmitted(self.whole_text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        # Terminals (and tmux) send a paste's line ends as carriage returns.
        text = event.text.replace("\r\n", "\n").replace("\r", "\n")
        lines = len(text.rstrip("\n").split("\n"))
        if lines <= FOLD_LINES or self.read_only:
            await super()._on_paste(event)
            return
        event.stop()
        event.prevent_default()
        tokens = self.count_tokens(text.strip())  # as it is sent
        counted = f" · {tokens:,} tokens" if tokens is not None else ""
        line = f"[pasted {lines:,} lines{counted}]"
        while line in self.pastes or line in self.text:  # a second paste of the same size
            line = line[:-1] + "+]"
        self.pastes[line] = text
        result = self.replace(line, *self.selection)
        self.move_cursor(result.end_location)

    def action_unfold(self) -> None:
        """The folded pastes written out in the text, to edit them."""
        if self.pastes:
            self.text = self.whole_text
            self.pastes.clear()
            self.move_cursor(self.document.end)
