"""The log view (F9): every HTTP request the engine answered (method, path, status, client,
tokens, time to first token, duration, an error's message) and lucedesk's warnings, newest
last, growing while it is open."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, RichLog


class LogScreen(Screen):
    CSS_PATH = "log.tcss"
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    @dataclass
    class Line(Message):
        """A line logged on any thread (post_message is thread-safe and never waits)."""

        text: str

    def compose(self) -> ComposeResult:
        yield Header()
        yield Label("HTTP requests and warnings, newest last", id="what")
        yield RichLog(id="log", wrap=True, markup=False, highlight=False)
        yield Footer()

    def on_mount(self) -> None:
        kept = self.app.kept_log
        view = self.query_one(RichLog)
        for line in list(kept.lines):
            view.write(line)
        if not kept.lines:
            view.write("nothing yet: requests to the HTTP server show here as they end")
        kept.shown = lambda line: self.post_message(self.Line(line))

    def on_log_screen_line(self, message: Line) -> None:
        self.query_one(RichLog).write(message.text)

    def on_unmount(self) -> None:
        self.app.kept_log.shown = None
