"""What the sidebar's keys do to a session: rename it (r) and delete it with its subagents'
sessions (Delete), each after a dialog."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lucedesk.tui.widgets.chat_pane import UNTITLED

if TYPE_CHECKING:
    from lucedesk.tui.screens.main import MainScreen


def rename(screen: MainScreen, session_id: int) -> None:
    from lucedesk.tui.screens.dialogs import TextDialog

    session = screen.app.store.session(session_id)
    if session is None:
        return

    def renamed(title: str | None) -> None:
        if not title or not title.strip():
            return
        for s in [session, *(p.session for p in screen.panes if p.session.id == session.id)]:
            s.title = title.strip()[:60]
        screen.app.store.update_session(session)
        for pane in screen.panes:
            pane.refresh_header()
        screen.refresh_sessions()

    screen.app.push_screen(TextDialog("Rename the session", session.title), renamed)


def delete(screen: MainScreen, session_id: int) -> None:
    from lucedesk.tui.screens.dialogs import ConfirmDialog

    session = screen.app.store.session(session_id)
    if session is None:
        return
    if screen.app.agents.running(session.id):
        screen.app.notify("That session is running; Esc stops it first.", severity="warning")
        return
    question = f"Delete {session.title!r} and its subagents' sessions? This cannot be undone."

    async def answered(choice: str | None) -> None:
        if choice != "delete":
            return
        screen.app.store.delete_session(session.id)
        screen.app.agents.live.pop(session.id, None)
        for pane in screen.panes:  # a pane showing it (or one of its children) starts anew
            if screen.app.store.session(pane.session.id) is None:
                await pane.show_session(screen.new_session(UNTITLED))
        screen.refresh_sessions()
        screen.app.notify(f"Deleted {session.title!r}.")

    screen.app.push_screen(ConfirmDialog(question, [("delete", "Delete")]), answered)
