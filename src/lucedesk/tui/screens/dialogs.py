"""Small modal dialogs: fan-out, its split, confirmations, a line of text."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from lucedesk.agent import split_text
from lucedesk.tui.widgets.text_area import TextArea


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
    ConfirmDialog Label { width: 100%; }
    ConfirmDialog Button { margin-right: 1; }
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

    def on_mount(self) -> None:
        self.query_one(Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None if event.button.id == "dismiss" else event.button.id)

    def key_escape(self) -> None:
        self.dismiss(None)


class TextDialog(ModalScreen[str | None]):
    """One line to type (a session's new title); Enter keeps it, Esc leaves it."""

    DEFAULT_CSS = """
    TextDialog { align: center middle; }
    TextDialog > Vertical { width: 70; height: auto; border: thick $accent; padding: 1 2;
                            background: $surface; }
    """

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__()
        self.question, self.value = question, value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            yield Input(self.value, id="text")
            yield Label("Enter keeps it · Esc leaves it as it was", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value)

    def key_escape(self) -> None:
        self.dismiss(None)


def parse_split(text: str) -> list[dict]:
    """The subtasks of an edited split: each a `## title` line, then its task."""
    subtasks: list[dict] = []
    for line in text.splitlines():
        if line.startswith("## "):
            subtasks.append({"title": line[3:].strip(), "task": ""})
        elif subtasks:
            subtasks[-1]["task"] = (subtasks[-1]["task"] + "\n" + line).strip()
    return [t for t in subtasks if t["title"] and t["task"]]


class SplitDialog(ModalScreen[list[dict] | None]):
    """A /fanout split before its subagents start: Enter runs it, e edits it (Esc ends the
    editing), n or Esc runs none. Dismisses with the subtasks or None."""

    DEFAULT_CSS = """
    SplitDialog { align: center middle; }
    SplitDialog > Vertical { width: 90%; height: auto; max-height: 90%; border: thick $accent;
                             padding: 1 2; background: $surface; }
    SplitDialog #split { height: auto; max-height: 24; border: round $panel; }
    SplitDialog TextArea { height: 20; }
    SplitDialog Horizontal { height: auto; margin-top: 1; }
    SplitDialog Button { margin-right: 1; }
    """
    BINDINGS = [
        Binding("enter,y", "run", "Run", priority=True),
        Binding("e", "edit", "Edit"),
        Binding("n,escape", "cancel", "Cancel", priority=True),
    ]

    def __init__(self, session_title: str, subtasks: list[dict]) -> None:
        super().__init__()
        self.session_title = session_title
        self.subtasks = subtasks

    def compose(self) -> ComposeResult:
        # The editor is composed with the dialog and shown in place of the split, not mounted
        # and removed: Textual can draw a TextArea it has just removed (a refresh that began
        # before the removal), and one never drawn before has no styles left by then: a
        # KeyError ('text-area--gutter') that stopped the app.
        with Vertical():
            yield Label(f"{self.session_title}: run these {len(self.subtasks)} subagents?")
            with VerticalScroll(id="split"):
                yield Static(split_text(self.subtasks), markup=False, id="shown")
            editor = TextArea(id="editor")
            editor.display = False
            yield editor
            with Horizontal():
                yield Button("Run (Enter)", variant="primary", id="run")
                yield Button("Edit (e)", id="edit")
                yield Button("Cancel (n)", variant="error", id="cancel")

    @property
    def editing(self) -> TextArea | None:
        area = self.query_one("#editor", TextArea)
        return area if area.display else None

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # While editing, Enter and letters are text; Esc ends the editing.
        if self.editing is not None and action in ("run", "edit"):
            return False
        return True

    def action_edit(self) -> None:
        area = self.query_one("#editor", TextArea)
        area.load_text(split_text(self.subtasks))
        self.query_one("#split").display = False
        area.display = True
        area.focus()

    def action_cancel(self) -> None:
        area = self.editing
        if area is None:
            self.dismiss(None)
            return
        edited = parse_split(area.text)
        if not edited:
            shape = "Each subtask is a '## title' line and its task below it."
            self.notify(shape, severity="error")
            return
        self.subtasks = edited
        area.display = False
        self.query_one("#shown", Static).update(split_text(edited))
        self.query_one("#split").display = True
        self.query_one(Label).update(f"{self.session_title}: run these {len(edited)} subagents?")
        self.query_one("#run", Button).focus()

    def action_run(self) -> None:
        self.dismiss(self.subtasks)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "run":
            self.action_run()
        elif event.button.id == "edit":
            self.action_edit()
        else:
            self.dismiss(None)
