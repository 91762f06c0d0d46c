"""Textual's TextArea, safe to draw after it was removed.

A refresh that began before a removal can still draw the removed widget, and a removed
TextArea has lost the component styles its theme reads: a KeyError ('text-area--gutter')
that stops the app. Closing a pane while its reply streams hit it. Drawn once removed, the
area is blank: nobody sees it, the next frame no longer has it."""

from __future__ import annotations

from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import TextArea as _TextArea


class TextArea(_TextArea):
    def render_lines(self, crop: Region) -> list[Strip]:
        if not self.is_attached:
            return [Strip.blank(crop.width) for _ in range(crop.height)]
        return super().render_lines(crop)
