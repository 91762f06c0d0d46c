"""The main screen: sessions sidebar, 1-4 chat panes side by side, the slot monitor."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.events import DescendantFocus
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, TextArea

from lucedesk.agent import ChildStarted, MessageAdded, PhaseChanged
from lucedesk.store import Session
from lucedesk.tui.messages import (
    AgentUpdate,
    SessionChosen,
    SessionsChanged,
)
from lucedesk.tui.screens.keys import KeysScreen
from lucedesk.tui.screens.sidebar_actions import SidebarActions
from lucedesk.tui.slash import COMMANDS, run_command
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.chat_pane import UNTITLED, ChatPane
from lucedesk.tui.widgets.engine_status import EngineStatus
from lucedesk.tui.widgets.session_list import SessionList
from lucedesk.tui.widgets.slot_monitor import SlotMonitor

MAX_PANES = 4


class MainScreen(SidebarActions, Screen):
    CSS_PATH = "main.tcss"
    # Priority: they work while the input has the focus (it has it nearly always), before
    # the text area's own keys (F6 select line, Ctrl+W/Ctrl+Y/Ctrl+E/Ctrl+F editing).
    BINDINGS = [
        Binding("escape", "stop", "Stop reply", priority=True),
        Binding("f1", "keys", "Keys", priority=True),
        Binding("ctrl+n", "new_session", "New chat", priority=True),
        Binding("ctrl+s", "split", "Split", priority=True),
        Binding("ctrl+w", "unsplit", "Close pane", priority=True),
        Binding("f6", "next_pane", "Next pane", priority=True),
        Binding("ctrl+g", "toggle_monitor", "Monitor", priority=True),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", priority=True),
        Binding("f2", "focus_sidebar", "Sessions", priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate", priority=True),
        Binding("ctrl+y", "copy_reply", "Copy reply", show=False, priority=True),
        Binding("ctrl+f", "fanout", "Fan out", priority=True),
        Binding("ctrl+e", "export", "Export", show=False, priority=True),
        Binding("f7", "models", "Models", priority=True),
        Binding("f8", "profiles", "Profiles", priority=True),
        Binding("f9", "log", "Log", priority=True),
        Binding("question_mark", "keys", "Keys", show=False),  # where no input takes it
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
        built = host.built  # None while a switch loads another model
        return built.engine.stats() if built is not None else None

    def remote_url(self) -> str:
        pane = self.pane()
        return pane.session.backend_url if pane is not None else ""

    async def on_mount(self) -> None:
        """The layout of the last run comes back: its panes, which had the focus, whether
        the sidebar and the monitor were shown."""
        app = self.app
        app.agents.show_on(self.post_message, self.watched_id)
        store = app.store
        layout = store.setting("layout", {})
        shown = [store.session(i) for i in layout.get("panes", [])]
        shown = [s for s in shown if s is not None][:MAX_PANES]
        if not shown:
            sessions = [s for s in store.sessions() if s.messages]
            shown = [sessions[-1] if sessions else self.new_session(UNTITLED)]
        self.query_one(SessionList).display = layout.get("sidebar", True)
        self.query_one(SlotMonitor).set_class(layout.get("monitor", False), "visible")
        for session in shown:
            await self.add_pane(session)
        focused = layout.get("focused", 0)
        self.panes[focused if 0 <= focused < len(self.panes) else 0].focus_input()
        self.refresh_sessions()
        typed, app.pending_input = app.pending_input, ""
        if typed:  # typed while the model loaded: there to edit or send, not sent
            box = self.pane().query_one(ChatInput)
            box.text = typed
            box.move_cursor(box.document.end)

    def save_layout(self) -> None:
        panes = self.panes
        current = self.pane()
        self.app.store.set_setting(
            "layout",
            {
                "panes": [p.session.id for p in panes],
                "focused": panes.index(current) if current in panes else 0,
                "sidebar": bool(self.query_one(SessionList).display),
                "monitor": self.query_one(SlotMonitor).has_class("visible"),
            },
        )

    def on_resize(self, event: events.Resize) -> None:
        self.query_one(SlotMonitor).fit(event.size.height)

    def on_key(self, event: events.Key) -> None:
        """A key typed while something in a pane other than its input has the focus (a
        tool block after a click) goes to that pane's input: nothing typed is lost."""
        if not event.is_printable or event.character is None or event.character == "?":
            return
        focused = self.focused
        if isinstance(focused, TextArea | Input):
            return
        if focused is not None and not any(isinstance(n, ChatPane) for n in focused.ancestors):
            return  # the sidebar's own keys (r, Delete) and the like
        pane = self.pane()
        if pane is not None:
            event.stop()
            box = pane.query_one(ChatInput)
            box.focus()
            box.insert(event.character)

    # -- panes ------------------------------------------------------------------------------

    @property
    def panes(self) -> list[ChatPane]:
        # Asked per agent event (every token): the box's children, not a query of the DOM.
        return [w for w in self.pane_box.children if isinstance(w, ChatPane) and not w.closing]

    async def add_pane(self, session: Session) -> ChatPane:
        pane = ChatPane(session, run_command)
        await self.pane_box.mount(pane)
        self.active = pane
        pane.focus_input()
        self.save_layout()
        return pane

    def on_descendant_focus(self, event: DescendantFocus) -> None:
        for node in event.widget.ancestors_with_self:
            if isinstance(node, ChatPane):
                if self.active is not node:
                    self.active = node
                    self.save_layout()
                break

    def pane(self) -> ChatPane | None:
        """The pane the user is in: the one holding the focus; with the focus elsewhere (the
        sidebar), the one that held it last. Every action and the watched mark follow it."""
        focused = self.focused
        for node in focused.ancestors_with_self if focused is not None else ():
            if isinstance(node, ChatPane):
                if not node.closing:
                    self.active = node
                    return node
                break
        if self.active is not None and self.active.is_attached and not self.active.closing:
            return self.active
        panes = self.panes
        return panes[0] if panes else None

    def watched_id(self) -> int | None:
        """The session the user is watching: the focused pane's."""
        pane = self.pane()
        return pane.session.id if pane is not None else None

    def new_session(self, title: str) -> Session:
        """A chat with the app's default tools, working in the app's workspace."""
        app = self.app
        return app.store.create_session(
            title, agent_type=app.agent_type, workspace=str(app.workspace)
        )

    def refresh_sessions(self) -> None:
        """The sidebar: every session with a word in it (a pane's new chat joins the list
        with its first message)."""
        self.query_one(SessionList).show([s for s in self.app.store.sessions(None) if s.messages])

    def on_sessions_changed(self, message: SessionsChanged) -> None:
        self.refresh_sessions()
        self.save_layout()

    async def on_agent_update(self, message: AgentUpdate) -> None:
        """An agent did something: the pane showing its session renders it; the sidebar
        shows new children and phases."""
        for pane in self.panes:
            if pane.session.id == message.event.session.id and not pane.closing:
                await pane.on_agent_update(message)
        event = message.event
        if isinstance(event, ChildStarted):
            self.refresh_sessions()
        elif isinstance(event, MessageAdded) and event.message is event.session.record.messages[0]:
            # A chat's first message: it joins the sidebar (by the time this is read, its
            # reply has been added too).
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
            if not message.clicked:
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
        if message.clicked:
            self.active = pane  # shown there; the focus stays in the sidebar for its keys
        else:
            pane.focus_input()

    # -- actions ----------------------------------------------------------------------------

    def action_stop(self) -> None:
        pane = self.pane()
        if pane is not None and pane.unqueue():  # a queued message first, back to edit
            return
        if pane is not None and pane.stop():
            kind = "Subagent" if pane.session.kind == "subagent" else "Agent"
            self.app.notify(f"{kind} {pane.session.title!r} stopped.")

    async def action_new_session(self) -> None:
        pane = self.pane()
        if pane is not None and pane.busy:
            self.app.notify("This pane is answering; split first or press Esc.", severity="warning")
            return
        session = self.new_session(UNTITLED)
        if pane is None:
            await self.add_pane(session)
        else:
            await pane.show_session(session)
            pane.focus_input()

    async def action_split(self) -> None:
        if len(self.panes) >= MAX_PANES:
            self.app.notify(f"At most {MAX_PANES} panes side by side.", severity="warning")
            return
        await self.add_pane(self.new_session(UNTITLED))

    async def action_unsplit(self) -> None:
        pane = self.pane()
        if pane is None or len(self.panes) == 1:
            self.app.notify("The last pane stays.", severity="warning")
            return
        pane.closing = True  # updates that arrive from here on are not shown
        pane.stop(take_back=False)
        self.app.forget_if_unused(pane.session)
        self.active = next(p for p in reversed(self.panes) if p is not pane)
        self.active.focus_input()
        await pane.remove()
        self.save_layout()

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
        self.save_layout()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one(SessionList)
        sidebar.display = not sidebar.display
        if not sidebar.display and sidebar.has_focus:
            self.action_next_pane()
        self.save_layout()

    def action_focus_sidebar(self) -> None:
        """F2: the sessions sidebar takes the focus (shown first if hidden): arrows move,
        Enter opens, r renames, Delete deletes; F6 goes back to a pane."""
        sidebar = self.query_one(SessionList)
        if not sidebar.display:
            sidebar.display = True
            self.save_layout()
        self.set_focus(sidebar)

    def action_keys(self) -> None:
        self.app.push_screen(KeysScreen(self.BINDINGS, COMMANDS))

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
        if pane is None:
            return
        try:
            self.app.notify(f"Exported to {pane.export()}")
        except OSError as exc:
            self.app.notify(f"Export failed: {exc}", severity="error")

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

    def action_log(self) -> None:
        from lucedesk.tui.screens.log import LogScreen

        self.app.push_screen(LogScreen())

    def action_models(self) -> None:
        from lucedesk.tui.screens.models import ModelsScreen

        self.app.push_screen(ModelsScreen())

    def action_profiles(self) -> None:
        from lucedesk.tui.screens.profiles import ProfilesScreen

        self.app.push_screen(ProfilesScreen())
