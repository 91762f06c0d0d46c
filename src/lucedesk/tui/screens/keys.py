"""Every key and slash command on one screen (F1, `?` where no input takes it, /help),
written from the bindings and the command table the main screen hands it, so it cannot
drift."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

from lucedesk.tui.widgets.session_list import MARKS, MEANINGS

if TYPE_CHECKING:
    from lucedesk.tui.slash import Command

INPUT_KEYS = [
    ("Enter", "send the message (or run the /command)"),
    ("Ctrl+J / Shift+Enter", "new line"),
    ("Ctrl+O", "unfold the pastes folded into one line, to edit them"),
    ("Esc", "a queued message back into the input (else: stop the reply)"),
    ("Ctrl+Z", "undo typing"),
]
SIDEBAR_KEYS = [
    ("Enter", "open the session (beside a busy pane)"),
    ("r", "rename the session"),
    ("Delete", "delete the session and its subagents' sessions"),
]
DIALOG_KEYS = [
    ("y / a / n", "approval: allow once / allow all until quit / deny"),
    ("Enter / e / n", "a /fanout split: run / edit (Esc ends editing) / cancel"),
]


def key_name(key: str) -> str:
    """ "ctrl+w" -> "Ctrl+W", "f6" -> "F6", "escape" -> "Esc"."""
    names = {"escape": "Esc", "question_mark": "?", "delete": "Delete", "enter": "Enter"}
    return "+".join(names.get(p, p.upper() if len(p) <= 3 else p.title()) for p in key.split("+"))


def key_rows(bindings: Iterable[Binding]) -> list[tuple[str, str]]:
    """One row per action: its keys ("F1 / ?") and what it does."""
    rows: dict[str, list[str]] = {}
    for b in bindings:
        rows.setdefault(b.description, []).append(key_name(b.key))
    return [(" / ".join(keys), action) for action, keys in rows.items()]


def table(title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, box=None, expand=True)
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    for key, what in rows:
        t.add_row(key, what)
    return t


class KeysScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    KeysScreen { align: center middle; }
    KeysScreen > Vertical { width: 90%; height: 90%; border: thick $accent; padding: 0 1;
                            background: $surface; }
    KeysScreen Label { color: $text-muted; }
    """
    BINDINGS = [Binding("escape,f1,q,question_mark", "app.pop_screen", "Close")]

    def __init__(self, bindings: Iterable[Binding], commands: Iterable[Command]) -> None:
        """`bindings`: the main screen's keys; `commands`: the slash commands."""
        super().__init__()
        command_rows = [(f"/{c.name} {c.usage}".rstrip(), c.help) for c in commands]
        marks = [(MARKS[k], MEANINGS[k]) for k in MARKS]
        self.tables = [
            table("Anywhere (also while typing)", key_rows(bindings)),
            table("In the input", INPUT_KEYS),
            table("Slash commands, typed in the input", command_rows),
            table("In the sidebar", SIDEBAR_KEYS),
            table("Sidebar marks", marks),
            table("In dialogs", DIALOG_KEYS),
            table("Everywhere else", [("Ctrl+P", "command palette")]),
        ]

    def text(self, width: int = 120) -> str:
        """The overlay's tables as plain text."""
        console = Console(width=width, record=True, file=io.StringIO())
        for t in self.tables:
            console.print(t)
        return console.export_text()

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Keys and commands · Esc closes")
            with VerticalScroll():
                for t in self.tables:
                    yield Static(t)

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()  # arrows and Page Up/Down scroll it
