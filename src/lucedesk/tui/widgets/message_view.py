"""One message of a conversation, rendered as Markdown; replies stream into it, their
reasoning (a thinking model's) folded under the title. A user message is shown as typed, a
long paste folded after its first lines."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from lucedesk.tui.widgets.chat_input import FOLD_LINES

SHOWN_LINES = 3  # of a user message longer than FOLD_LINES, shown before it is opened


class MessageView(Vertical):
    # Markdown updates per second while a reply streams: each lays the pane out again, and
    # on a 2-core machine the UI thread's time is taken from the engine's (10 a second cost
    # about twice the UI time of 6; see docs/benchmarks.md). Text arriving in between goes
    # out with the next.
    RENDERS_PER_SECOND = 6

    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; }
    MessageView > Label { color: $text-muted; text-style: bold; }
    MessageView.user > Label { color: $accent; }
    MessageView.assistant > Label { color: $success; }
    MessageView > Markdown { margin: 0; padding: 0 1; }
    MessageView > .typed { padding: 0 1; }
    MessageView > Collapsible { margin: 0; padding: 0; border: none; }
    MessageView .reasoning { color: $text-muted; padding: 0 1; }
    """

    def __init__(
        self, role: str, content: str = "", title: str | None = None, reasoning: str = ""
    ) -> None:
        super().__init__(classes=role)
        self.role = role
        self.content = content
        self.title = title or role
        self.reasoning = reasoning
        self._stream: MarkdownStream | None = None
        self._pending = ""
        self._rendered_at = 0.0

    def compose(self) -> ComposeResult:
        yield Label(self.title)
        if self.reasoning:
            yield self._reasoning_block()
        if self.role == "user":  # as typed or pasted, every line its own (not Markdown's)
            lines = self.content.split("\n")
            if len(lines) <= FOLD_LINES:
                yield Static(self.content, classes="typed", markup=False)
                return
            # a long paste: its first lines, the rest laid out when opened
            yield Static("\n".join(lines[:SHOWN_LINES]), classes="typed", markup=False)
            yield Collapsible(
                Static("", classes="typed rest", markup=False),
                title=f"{len(lines) - SHOWN_LINES:,} more lines ({len(lines):,} in all)",
                collapsed=True,
                classes="paste",
            )
        else:
            yield Markdown(self.content)

    def _reasoning_block(self) -> Collapsible:
        return Collapsible(
            Static(self.reasoning, classes="reasoning", markup=False),
            title="thinking",
            collapsed=True,
        )

    async def show_reasoning(self, reasoning: str) -> None:
        """The reply's reasoning so far, folded (opened by a click). While folded, the text
        is only kept: a long reasoning is laid out when it is opened, not at every piece."""
        self.reasoning = reasoning
        if not self.is_attached:  # the app is quitting
            return
        found = self.query(Collapsible)
        if not found:
            await self.mount(self._reasoning_block(), before=self.markdown)
        elif not found.first().collapsed:
            self._write_reasoning(found.first())

    def _write_reasoning(self, block: Collapsible) -> None:
        block.query_one(".reasoning", Static).update(self.reasoning)

    def on_collapsible_expanded(self, event: Collapsible.Expanded) -> None:
        if event.collapsible.has_class("paste"):
            rest = self.content.split("\n")[SHOWN_LINES:]
            event.collapsible.query_one(".rest", Static).update("\n".join(rest))
        else:
            self._write_reasoning(event.collapsible)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, text: str) -> bool:
        """Add streamed text; it is rendered at most RENDERS_PER_SECOND times a second.
        True when it was rendered now."""
        self.content += text
        self._pending += text
        if time.monotonic() - self._rendered_at >= 1 / self.RENDERS_PER_SECOND:
            await self._render_pending()
            return True
        return False

    async def _render_pending(self) -> None:
        if not self._pending or not self.is_attached:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        text, self._pending = self._pending, ""
        await self._stream.write(text)
        self._rendered_at = time.monotonic()

    async def replace(self, text: str) -> None:
        """Show `text` instead (a reply rewritten when it ended: a /fanout split; one
        written on from its text trimmed)."""
        self.content, self._pending = text, ""
        if self._stream is not None:  # what streams next goes after the new text
            await self._stream.stop()
            self._stream = None
        if not self.is_attached:  # the app is quitting
            return
        if self.role == "user":
            self.query(".typed").first(Static).update(text)
            return
        await self.markdown.update(text)
        self._rendered_at = time.monotonic()

    async def finish(self, note: str | None = None) -> None:
        await self._render_pending()
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.retitle(note)

    def retitle(self, note: str | None) -> None:
        """The role, and how the message ended (None: it did not, or not yet)."""
        self.title = f"{self.role} · {note}" if note else self.role
        # Not once the view is being taken down (its pane closed, Ctrl+Q): the title may be
        # gone already.
        for label in self.query(Label).results(Label):
            label.update(self.title)
            break
