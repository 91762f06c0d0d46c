"""Asks before an agent changes a file or runs a command: the diff or the command, then
allow once, allow for the rest of the run (edits, or commands), or deny."""

from __future__ import annotations

from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from lucedesk.agent import ApprovalRequest


class ApprovalDialog(ModalScreen[str]):
    """Dismisses with "once", "always" or "deny"."""

    DEFAULT_CSS = """
    ApprovalDialog { align: center middle; }
    ApprovalDialog > Vertical { width: 90%; height: auto; max-height: 90%;
                                border: thick $warning; padding: 1 2; background: $surface; }
    ApprovalDialog #detail { height: auto; max-height: 30; border: round $panel; }
    ApprovalDialog Horizontal { height: auto; margin-top: 1; }
    ApprovalDialog Button { margin-right: 1; }
    """
    BINDINGS = [
        Binding("y", "answer('once')", "Allow"),
        Binding("a", "answer('always')", "Allow all"),
        Binding("n,escape", "answer('deny')", "Deny"),
    ]

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__()
        self.request = request

    def compose(self) -> ComposeResult:
        r = self.request
        # "all" holds for every session until lucedesk quits (--allow-* makes it the default)
        always = "Allow all edits" if r.kind == "edit" else "Allow all commands"
        always += " until quit"
        lexer = "diff" if r.kind == "edit" else "bash"
        with Vertical():
            yield Label(Text.assemble((r.session_title, "bold"), " wants to ", r.summary))
            with VerticalScroll(id="detail"):
                yield Static(Syntax(r.detail, lexer, word_wrap=True, theme="ansi_dark"))
            with Horizontal():
                yield Button("Allow (y)", variant="success", id="once")
                yield Button(f"{always} (a)", variant="warning", id="always")
                yield Button("Deny (n)", variant="error", id="deny")

    def on_mount(self) -> None:
        self.query_one("#once", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id)

    def action_answer(self, choice: str) -> None:
        self.dismiss(choice)
