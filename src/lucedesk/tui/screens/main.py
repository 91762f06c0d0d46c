"""The main screen: sessions sidebar, 1-4 chat panes side by side, the slot monitor."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.events import DescendantFocus
from textual.screen import Screen
from textual.widgets import Footer, Header

from lucedesk.agent import ChildStarted, PhaseChanged
from lucedesk.store import Session
from lucedesk.tui.messages import AgentUpdate, SessionChosen, SessionsChanged
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.chat_pane import ChatPane
from lucedesk.tui.widgets.engine_status import EngineStatus
from lucedesk.tui.widgets.session_list import SessionList
from lucedesk.tui.widgets.slot_monitor import SlotMonitor

MAX_PANES = 4


class MainScreen(Screen):
    CSS_PATH = "main.tcss"
    BINDINGS = [
        Binding("escape", "stop", "Stop reply"),
        Binding("ctrl+n", "new_session", "New chat"),
        Binding("ctrl+s", "split", "Split"),
        Binding("ctrl+w", "unsplit", "Close pane"),
        Binding("f6", "next_pane", "Next pane"),
        Binding("ctrl+g", "toggle_monitor", "Monitor"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+y", "copy_reply", "Copy reply"),
        Binding("ctrl+f", "fanout", "Fan out"),
        Binding("ctrl+e", "export", "Export", show=False),
        Binding("f8", "profiles", "Profiles"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.active: ChatPane | None = None
        self.pane_box = Horizontal(id="panes")

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            yield SessionList(self.phase_of, id="sessions")
            yield self.pane_box
        yield SlotMonitor(self.current_stats, self.remote_url)
        yield EngineStatus(self.current_stats)
        yield Footer()

    def phase_of(self, session_id: int) -> str | None:
        agent = self.app.agents.live.get(session_id)
        return agent.phase if agent is not None and agent.running else None

    def current_stats(self):
        host = self.app.host
        return host.engine.stats() if host.built is not None else None

    def remote_url(self) -> str:
        pane = self.pane()
        return pane.session.backend_url if pane is not None else ""

    async def on_mount(self) -> None:
        self.app.agents.screen = self
        store = self.app.store
        sessions = store.sessions()
        session = sessions[-1] if sessions else self.new_session("Chat 1")
        self.refresh_sessions()
        pane = await self.add_pane(session)
        typed, self.app.pending_input = self.app.pending_input, ""
        if typed:  # typed while the model loaded: there to edit or send, not sent
            box = pane.query_one(ChatInput)
            box.text = typed
            box.move_cursor(box.document.end)

    # -- panes ------------------------------------------------------------------------------

    @property
    def panes(self) -> list[ChatPane]:
        # Asked per agent event (every token): the box's children, not a query of the DOM.
        return [w for w in self.pane_box.children if isinstance(w, ChatPane)]

    async def add_pane(self, session: Session) -> ChatPane:
        pane = ChatPane(session)
        await self.pane_box.mount(pane)
        self.active = pane
        pane.focus_input()
        return pane

    def on_descendant_focus(self, event: DescendantFocus) -> None:
        for node in event.widget.ancestors_with_self:
            if isinstance(node, ChatPane):
                self.active = node
                break

    def pane(self) -> ChatPane | None:
        if self.active is not None and self.active.is_attached:
            return self.active
        panes = self.panes
        return panes[0] if panes else None

    def new_session(self, title: str) -> Session:
        """A chat with the app's default tools, working in the app's workspace."""
        app = self.app
        return app.store.create_session(
            title, agent_type=app.agent_type, workspace=str(app.workspace)
        )

    def refresh_sessions(self) -> None:
        self.query_one(SessionList).show(self.app.store.sessions(None))

    def on_sessions_changed(self, message: SessionsChanged) -> None:
        self.refresh_sessions()

    async def on_agent_update(self, message: AgentUpdate) -> None:
        """An agent did something: the pane showing its session renders it; the sidebar
        shows new children and phases."""
        for pane in self.panes:
            if pane.session.id == message.event.session.id:
                await pane.on_agent_update(message)
        if isinstance(message.event, ChildStarted):
            self.refresh_sessions()
        elif isinstance(message.event, PhaseChanged):
            self.query_one(SessionList).relabel(message.event.session.record)

    async def on_session_chosen(self, message: SessionChosen) -> None:
        pane = self.pane()
        live = self.app.agents.live.get(message.session_id)
        target = live.record if live is not None else self.app.store.session(message.session_id)
        if target is None:
            return
        shown = next((p for p in self.panes if p.session.id == target.id), None)
        if shown is not None:
            shown.focus_input()
            return
        if pane is not None and pane.busy and len(self.panes) < MAX_PANES:
            await self.add_pane(target)  # the busy pane goes on; this opens beside it
            return
        if pane is None or pane.busy:
            self.app.notify(
                "That pane is answering; pick another pane or press Esc.", severity="warning"
            )
            return
        await pane.show_session(target)
        pane.focus_input()

    # -- actions ----------------------------------------------------------------------------

    def action_stop(self) -> None:
        pane = self.pane()
        if pane is not None and pane.stop():
            kind = "Subagent" if pane.session.kind == "subagent" else "Agent"
            self.app.notify(f"{kind} {pane.session.title!r} stopped.")

    async def action_new_session(self) -> None:
        pane = self.pane()
        if pane is not None and pane.busy:
            self.app.notify("This pane is answering; split first or press Esc.", severity="warning")
            return
        count = len(self.app.store.sessions()) + 1
        session = self.new_session(f"Chat {count}")
        self.refresh_sessions()
        if pane is None:
            await self.add_pane(session)
        else:
            await pane.show_session(session)
            pane.focus_input()

    async def action_split(self) -> None:
        if len(self.panes) >= MAX_PANES:
            self.app.notify(f"At most {MAX_PANES} panes side by side.", severity="warning")
            return
        count = len(self.app.store.sessions()) + 1
        session = self.new_session(f"Chat {count}")
        self.refresh_sessions()
        await self.add_pane(session)

    async def action_unsplit(self) -> None:
        pane = self.pane()
        if pane is None or len(self.panes) == 1:
            self.app.notify("The last pane stays.", severity="warning")
            return
        pane.stop(take_back=False)
        await pane.remove()
        self.active = self.panes[-1]
        self.active.focus_input()

    def action_next_pane(self) -> None:
        panes = self.panes
        if not panes:
            return
        current = self.pane()
        index = panes.index(current) if current in panes else -1
        panes[(index + 1) % len(panes)].focus_input()

    def action_toggle_monitor(self) -> None:
        monitor = self.query_one(SlotMonitor)
        monitor.toggle_class("visible")
        monitor.refresh_stats()

    async def action_regenerate(self) -> None:
        pane = self.pane()
        if pane is not None:
            await pane.regenerate()

    def action_copy_reply(self) -> None:
        pane = self.pane()
        text = pane.last_reply() if pane else None
        if not text:
            self.app.notify("No reply to copy yet.", severity="warning")
            return
        self.app.copy_to_clipboard(text)
        self.app.notify("Last reply copied.")

    def action_export(self) -> None:
        pane = self.pane()
        if pane is not None:
            self.app.notify(f"Exported to {pane.export()}")

    def action_fanout(self) -> None:
        from lucedesk.tui.screens.dialogs import FanoutDialog

        pane = self.pane()
        if pane is None:
            return

        def chosen(result: tuple[int, str] | None) -> None:
            if result is None:
                return
            try:
                pane.start_fanout(*result)
            except ValueError as exc:
                self.app.notify(f"Fan-out: {exc}", severity="error")

        self.app.push_screen(FanoutDialog(), chosen)

    def action_profiles(self) -> None:
        from lucedesk.tui.screens.profiles import ProfilesScreen

        self.app.push_screen(ProfilesScreen())
