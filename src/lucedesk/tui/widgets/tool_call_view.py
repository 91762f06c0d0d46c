"""One tool call in a transcript, collapsed to a line (name, arguments, how it ended);
expanded, the arguments and the first lines of the result."""

from __future__ import annotations

import json

from textual.content import Content
from textual.widgets import Collapsible, Static

from lucedesk.store import StoredMessage

PREVIEW_LINES = 24
STATES = ("running", "error", "done")


def brief_arguments(arguments: str, width: int = 60) -> str:
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return arguments[:width]
    if not isinstance(args, dict):
        return str(args)[:width]
    text = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
    return text if len(text) <= width else text[: width - 1] + "…"


class ToolCallView(Collapsible):
    DEFAULT_CSS = """
    ToolCallView { height: auto; margin: 0 0 1 0; border: none; padding: 0; }
    ToolCallView.error CollapsibleTitle { color: $error; }
    ToolCallView.running CollapsibleTitle { color: $warning; }
    ToolCallView Static { color: $text-muted; }
    """

    def __init__(self, message: StoredMessage) -> None:
        self.message = message
        super().__init__(Static("", id="body", markup=False), title=self.heading(), collapsed=True)
        self.add_class(self.state())

    def state(self) -> str:
        status = self.message.status
        if status == "streaming":
            return "running"
        if status == "interrupted" or self.message.error:
            return "error"
        return "done"

    def heading(self) -> Content:
        call = self.message
        status = call.status
        first = call.content.strip().splitlines()
        if status == "streaming":
            end = "running…"
        elif status == "interrupted":
            end = "interrupted"
        else:
            end = first[0][:70] if first else "done"
        shown = f"{call.name or '?'}({brief_arguments(call.arguments)})"
        return Content(f"⚙ {shown} · {end}")  # plain text: arguments may hold brackets

    def body_text(self) -> str:
        lines = self.message.content.splitlines()
        shown = "\n".join(lines[:PREVIEW_LINES])
        if len(lines) > PREVIEW_LINES:
            shown += f"\n… {len(lines) - PREVIEW_LINES} more lines"
        return f"arguments: {self.message.arguments}\n\n{shown}"

    def on_mount(self) -> None:
        self.query_one("#body", Static).update(self.body_text())

    def update_call(self, message: StoredMessage) -> None:
        self.message = message
        self.title = self.heading()
        # Only the state's own classes: Collapsible folds itself with a class of its own.
        self.remove_class(*STATES)
        self.add_class(self.state())
        self.query_one("#body", Static).update(self.body_text())
