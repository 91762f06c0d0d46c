"""Small modal dialogs: fan-out and confirmations."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label


class FanoutDialog(ModalScreen[tuple[int, str] | None]):
    """Ask for N and the task; dismisses with (N, task) or None."""

    DEFAULT_CSS = """
    FanoutDialog { align: center middle; }
    FanoutDialog > Vertical { width: 70; height: auto; border: thick $accent; padding: 1 2;
                              background: $surface; }
    FanoutDialog Horizontal { height: auto; margin-top: 1; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Fan out subagents from this conversation")
            yield Input(placeholder="how many (1 to the slot count)", id="count", type="integer")
            yield Input(placeholder="the task each subagent works on", id="task")
            with Horizontal():
                yield Button("Fan out", variant="primary", id="go")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        self._submit()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._submit()

    def _submit(self) -> None:
        count = self.query_one("#count", Input).value.strip()
        task = self.query_one("#task", Input).value.strip()
        if not count.isdigit() or not task:
            self.app.notify("Give a number of subagents and a task.", severity="error")
            return
        self.dismiss((int(count), task))


class ConfirmDialog(ModalScreen[str | None]):
    """A question with buttons; dismisses with the chosen button id or None."""

    DEFAULT_CSS = """
    ConfirmDialog { align: center middle; }
    ConfirmDialog > Vertical { width: 70; height: auto; border: thick $warning; padding: 1 2;
                               background: $surface; }
    ConfirmDialog Horizontal { height: auto; margin-top: 1; }
    """

    def __init__(self, question: str, choices: list[tuple[str, str]]) -> None:
        super().__init__()
        self.question, self.choices = question, choices

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            with Horizontal():
                for ident, text in self.choices:
                    yield Button(text, id=ident)
                yield Button("Back", id="dismiss")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None if event.button.id == "dismiss" else event.button.id)
