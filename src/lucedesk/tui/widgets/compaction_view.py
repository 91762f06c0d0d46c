"""A compaction in the transcript: one line saying how many messages the model now reads as a
summary; opened, that summary. The messages it covers stay above it, as they were."""

from __future__ import annotations

from textual.widgets import Collapsible, Static

from lucedesk.agent import marker_line
from lucedesk.store import StoredMessage


class CompactionView(Collapsible):
    DEFAULT_CSS = """
    CompactionView { margin: 0 0 1 0; padding: 0; border: none; color: $text-muted; }
    CompactionView .summary { color: $text-muted; padding: 0 1; }
    """

    def __init__(self, message: StoredMessage) -> None:
        super().__init__(
            Static(message.content, classes="summary", markup=False),
            title=marker_line(message),
            collapsed=True,
        )
