"""One message of a conversation, rendered as Markdown; replies stream into it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Markdown
from textual.widgets.markdown import MarkdownStream


class MessageView(Vertical):
    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; }
    MessageView > Label { color: $text-muted; text-style: bold; }
    MessageView.user > Label { color: $accent; }
    MessageView.assistant > Label { color: $success; }
    MessageView > Markdown { margin: 0; padding: 0 1; }
    """

    def __init__(self, role: str, content: str = "", title: str | None = None) -> None:
        super().__init__(classes=role)
        self.role = role
        self.content = content
        self.title = title or role
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Label(self.title)
        yield Markdown(self.content)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, text: str) -> None:
        """Add streamed text; Markdown.get_stream batches renders instead of one per token."""
        self.content += text
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(text)

    async def finish(self, note: str | None = None) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if note:
            self.query_one(Label).update(f"{self.title} · {note}")
