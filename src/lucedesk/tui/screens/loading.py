"""Start-up: resolve the profile, pull the model if needed, start the engine and the HTTP
server on a worker thread, so the screen never freezes. Meanwhile the user can type the first
message; the app hands it to the main screen's first input when the engine is ready."""

from __future__ import annotations

import time

from textual import work
from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Input, Label, LoadingIndicator, Static

from lucedesk.errors import LucedeskError

KEPT_NOTE = "your message will be in the input when the model is ready"


class LoadingScreen(Screen):
    CSS_PATH = "loading.tcss"

    def __init__(self) -> None:
        super().__init__()
        self.progress = "starting"  # the engine's last progress line
        self.kept = False  # Enter was pressed: the text waits for the main screen
        self.stages: list[tuple[str, float]] = []  # (line, when it began), the last under way

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            yield Label("lucedesk", id="title")
            yield LoadingIndicator()
            yield Static("", id="stages")
            yield Label(self.progress, id="status")
            yield Input(placeholder="type your first message while the model loads", id="early")

    def on_mount(self) -> None:
        self.query_one("#early", Input).focus()
        self.start_engine()

    def typed(self) -> str:
        """What the user typed so far, to put in the first pane's input."""
        return self.query_one("#early", Input).value

    def on_input_submitted(self, event: Input.Submitted) -> None:
        # Not sent: there is no engine yet. The text stays, and moves to the chat input.
        event.stop()
        if event.value.strip():
            self.kept = True
            self.show_progress(self.progress)

    def on_input_changed(self, event: Input.Changed) -> None:
        if self.kept and not event.value.strip():  # cleared: nothing waits any more
            self.kept = False
            self.show_progress(self.progress)

    def show_progress(self, text: str) -> None:
        """Each start-up stage on its line: those done with a mark and the seconds they
        took, the one under way last (a stage saying how far it is replaces its line)."""
        if text != self.progress:
            now = time.monotonic()
            same = self.stages and self.stages[-1][0].split(":")[0] == text.split(":")[0]
            if same and ":" in text:
                self.stages[-1] = (text, self.stages[-1][1])
            else:
                self.stages.append((text, now))
            self.query_one("#stages", Static).update(self.stage_text())
        self.progress = text
        note = KEPT_NOTE if self.kept else ""
        self.query_one("#status", Label).update(note)

    def stage_text(self) -> str:
        lines = [
            f"✓ {line} ({later - began:.1f} s)"
            for (line, began), (_, later) in zip(self.stages, self.stages[1:])
        ]
        return "\n".join([*lines, f"… {self.stages[-1][0]}"]) if self.stages else ""

    def say(self, text: str) -> None:
        self.app.call_from_thread(self.show_progress, text)

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
