"""What the sidebar's keys do to a session: rename it (r) and delete it with its subagents'
sessions (Delete), each after a dialog. Mixed into the main screen, whose panes,
`new_session` and `refresh_sessions` they use."""

from __future__ import annotations

from lucedesk.tui.messages import SessionDeleteAsked, SessionRenameAsked
from lucedesk.tui.widgets.chat_pane import UNTITLED


class SidebarActions:
    def on_session_rename_asked(self, message: SessionRenameAsked) -> None:
        from lucedesk.tui.screens.dialogs import TextDialog

        session = self.app.store.session(message.session_id)
        if session is None:
            return

        def renamed(title: str | None) -> None:
            if not title or not title.strip():
                return
            for s in [session, *(p.session for p in self.panes if p.session.id == session.id)]:
                s.title = title.strip()[:60]
            self.app.store.update_session(session)
            for pane in self.panes:
                pane.refresh_header()
            self.refresh_sessions()

        self.app.push_screen(TextDialog("Rename the session", session.title), renamed)

    def on_session_delete_asked(self, message: SessionDeleteAsked) -> None:
        from lucedesk.tui.screens.dialogs import ConfirmDialog

        app = self.app
        session = app.store.session(message.session_id)
        if session is None:
            return
        if app.agents.running(session.id):
            app.notify("That session is running; Esc stops it first.", severity="warning")
            return
        question = f"Delete {session.title!r} and its subagents' sessions? This cannot be undone."

        async def answered(choice: str | None) -> None:
            if choice != "delete":
                return
            app.store.delete_session(session.id)
            app.agents.live.pop(session.id, None)
            for pane in self.panes:  # a pane showing it (or one of its children) starts anew
                if app.store.session(pane.session.id) is None:
                    await pane.show_session(self.new_session(UNTITLED))
            self.refresh_sessions()
            app.notify(f"Deleted {session.title!r}.")

        app.push_screen(ConfirmDialog(question, [("delete", "Delete")]), answered)
