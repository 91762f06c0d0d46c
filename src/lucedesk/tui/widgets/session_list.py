"""The sessions sidebar."""

from __future__ import annotations

from textual.widgets import Label, ListItem, ListView

from lucedesk.store import Session
from lucedesk.tui.messages import SessionChosen


class SessionList(ListView):
    DEFAULT_CSS = """
    SessionList { width: 26; border: round $panel; }
    """

    def show(self, sessions: list[Session]) -> None:
        self.clear()
        for s in sessions:
            item = ListItem(Label(s.title))
            item.session_id = s.id
            self.append(item)

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        self.post_message(SessionChosen(event.item.session_id))
