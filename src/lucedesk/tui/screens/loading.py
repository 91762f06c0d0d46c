"""Start-up: resolve the profile, pull the model if needed, start the engine and the HTTP
server on a worker thread, so the screen never freezes."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Label, LoadingIndicator

from lucedesk.errors import LucedeskError


class LoadingScreen(Screen):
    CSS_PATH = "loading.tcss"

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            yield Label("lucedesk", id="title")
            yield LoadingIndicator()
            yield Label("starting", id="status")

    def on_mount(self) -> None:
        self.start_engine()

    def say(self, text: str) -> None:
        self.app.call_from_thread(self.query_one("#status", Label).update, text)

    @work(thread=True, exit_on_error=False)
    def start_engine(self) -> None:
        try:
            self.app.host.start(self.say)
        except LucedeskError as exc:
            self.app.call_from_thread(self.app.startup_failed, str(exc))
            return
        except Exception as exc:  # anything else: still a message, not a traceback on screen
            self.app.call_from_thread(self.app.startup_failed, f"{type(exc).__name__}: {exc}")
            return
        self.app.call_from_thread(self.app.engine_ready)
