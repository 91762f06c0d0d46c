"""A chat pane: one session's conversation (a chat, an agent with tools, or a subagent
opened from the sidebar), its input, and its agent's live work: replies streaming in, tool
calls as compact blocks."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.dom import NoScreen
from textual.geometry import Size
from textual.widgets import Label, Static

from lucedesk.agent import AgentSession
from lucedesk.chat import ToolChoice, format_of
from lucedesk.export import export_dir, export_markdown, slug
from lucedesk.store import Session, StoredMessage
from lucedesk.tui.messages import AgentUpdate, SessionsChanged
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.compaction_view import CompactionView
from lucedesk.tui.widgets.message_view import MessageView
from lucedesk.tui.widgets.pane_input import PaneInput
from lucedesk.tui.widgets.pane_updates import PaneUpdates, shown_text
from lucedesk.tui.widgets.tool_call_view import ToolCallView

UNTITLED = "New chat"
WELCOME = (
    "Type a message, Enter sends (Ctrl+J: new line). Esc stops a reply · Ctrl+S splits · "
    "Ctrl+G shows the slots · Ctrl+B the sidebar · F1 every key · /help every command"
)


def untitled(title: str) -> bool:
    """A title lucedesk gave, which the first message may replace."""
    return title == UNTITLED or re.fullmatch(r"Chat \d+", title) is not None


def title_from(text: str) -> str:
    """A session's title from its first message: its first line, at most 40 characters."""
    line = " ".join(text.split())
    return line if len(line) <= 40 else line[:39].rstrip() + "…"


class Transcript(VerticalScroll, can_focus=False):
    """The conversation; follows new output unless scrolled up, and then says that there is
    more below. Never takes the focus: typing goes to the input."""

    following = True  # kept at the end as output comes

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if new_value < old_value and new_value < self.max_scroll_y:
            self.following = False  # the user scrolled up (content shrinking clamps to max)
        elif new_value >= self.max_scroll_y:
            self.following = True
            self.parent.new_below(False)

    def grew(self) -> None:
        """Content was added: followed to the end, or marked as below."""
        if self.following:
            self.scroll_end(animate=False)
        else:
            self.parent.new_below(True)

    def watch_virtual_size(self, old: Size, new: Size) -> None:
        """A streamed reply's Markdown lays itself out after the write that fed it: while
        following, the end is followed whenever the content grows, not only when told."""
        if self.following and new.height > old.height:
            self.scroll_end(animate=False)

    def jump_to_end(self) -> None:
        self.following = True
        self.scroll_end(animate=False)


# Runs a slash command line typed in a pane (slash.run_command); False when it failed.
CommandRunner = Callable[["ChatPane", str], Awaitable[bool]]


class ChatPane(PaneUpdates, PaneInput, Vertical, can_focus=False):
    DEFAULT_CSS = """
    ChatPane { width: 1fr; border: round $panel; }
    ChatPane:focus-within { border: round $accent; }
    ChatPane > #header { height: 1; padding: 0 1; color: $text-muted; text-wrap: nowrap;
                         text-overflow: ellipsis; width: 1fr; }
    ChatPane > #log { height: 1fr; padding: 0 1; }
    ChatPane #welcome { color: $text-muted; padding: 1 1; }
    ChatPane > #new-below { height: 1; width: 1fr; content-align: center middle;
                            background: $accent 30%; display: none; }
    ChatPane > #new-below.shown { display: block; }
    ChatPane > #queued { height: auto; max-height: 2; padding: 0 1; color: $warning;
                         display: none; }
    ChatPane > #queued.shown { display: block; }
    """

    def __init__(self, session: Session, run_command: CommandRunner) -> None:
        super().__init__()
        self.session = session
        self.run_command = run_command  # a slash command line: False when it failed
        self.views: dict[int, MessageView | ToolCallView | CompactionView] = {}  # by message id
        self._starting = False  # a run is on its way to the agent (busy before it starts)
        self._take_back = True  # a run stopped before a word puts its question back
        self.closing = False  # being taken down (Ctrl+W): updates that arrive are dropped
        # /tool-choice's choices for the next run (typed while one runs, they wait for it)
        self.next_choices: list[ToolChoice] | None = None
        self.setup_input()

    def compose(self) -> ComposeResult:
        yield Label(self.header_text(), id="header")
        yield Transcript(id="log")
        yield Label("↓ new output below · click or End to follow", id="new-below")
        yield Label("", id="queued")
        yield ChatInput(id="input")

    async def on_mount(self) -> None:
        self.query_one(ChatInput).count_tokens = self.count_text
        await self.show_session(self.session)

    @property
    def log_view(self) -> Transcript:
        return self.query_one("#log", Transcript)

    def new_below(self, shown: bool) -> None:
        self.query_one("#new-below").set_class(shown, "shown")

    def on_click(self, event) -> None:
        if event.widget is not None and event.widget.id == "new-below":
            self.log_view.jump_to_end()
            self.new_below(False)
        self.focus_input()  # a click anywhere in the pane leaves the typing where it was

    @property
    def gone(self) -> bool:
        """Closed, closing, or the app quitting: nothing is shown here any more."""
        return self.closing or not self.is_attached

    def follow(self) -> None:
        if not self.gone:  # updates may still arrive for a pane being taken down
            self.log_view.grew()

    # -- state ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._starting or self.app.agents.running(self.session.id)

    def header_text(self) -> str:
        """The live phase first (a narrow pane cuts the end), then the session's settings."""
        s = self.session
        agent = self.app.agents.live.get(s.id)
        phase = f"● {agent.phase} · " if agent is not None and agent.running else ""
        kind = "subagent · " if s.kind == "subagent" else ""
        tools = "no tools" if s.agent_type == "chat" else f"{s.agent_type} tools"
        system = " · system prompt set" if s.system_prompt and s.kind != "subagent" else ""
        backend = f" · via {s.backend_url}" if s.backend_url else ""
        return (
            f"{phase}{self.context_text()}{kind}{s.title} · {tools} · temp {s.temperature:g}"
            f" · max {s.max_tokens}{system}{backend}"
        )

    def refresh_header(self) -> None:
        for header in self.query("#header").results(Label):  # none once the pane is gone
            header.update(self.header_text())

    async def show_session(self, session: Session) -> None:
        """Shows `session` here; the draft typed for the one shown before stays with it."""
        box = self.query_one(ChatInput)
        drafts = self.app.drafts
        if self.is_mounted and self.session.id != session.id:
            drafts[self.session.id] = box.whole_text
            self.app.forget_if_unused(self.session)
        live = self.app.agents.live.get(session.id)
        self.session = live.record if live is not None else session  # a running child's own
        log = self.log_view
        await log.remove_children()
        self.views = {}
        views = [self.view_for(m) for m in self.session.messages]
        if not views:
            views = [Static(WELCOME, id="welcome")]
        await log.mount_all([v for v in views if v is not None])
        box.clear()
        box.text = drafts.pop(self.session.id, "")
        box.move_cursor(box.document.end)
        log.jump_to_end()
        self.new_below(False)
        self.context = None
        self.refresh_header()
        self.measure_context()
        self.post_message(SessionsChanged())

    def view_for(self, m: StoredMessage) -> MessageView | ToolCallView | CompactionView | None:
        """The widget of one stored message (remembered by id, so updates find it)."""
        if m.role == "compaction":
            view = CompactionView(m)
        elif m.role == "tool":
            view = ToolCallView(m)
        elif m.role == "assistant" and not m.content and m.tool_calls:
            if not m.streaming:
                return None  # its calls follow, each in its own block
            view = MessageView("assistant")
        else:  # how it ended (stopped, cut, failed, interrupted) stays on it after a reload
            notes = m.notes() if not m.streaming else []
            title = " · ".join([m.role, *notes]) if notes else None
            view = MessageView(m.role, shown_text(m), title=title, reasoning=m.reasoning)
        self.views[m.id] = view
        return view

    def focus_input(self) -> None:
        """The focus on this pane's input now, not at the app's next idle moment (what
        `focus()` does): a key typed right after F6 goes here, however busy the app."""
        for box in self.query(ChatInput).results(ChatInput):
            try:
                self.screen.set_focus(box)
            except NoScreen:
                box.focus()

    # -- input ------------------------------------------------------------------------------

    async def send(self, text: str) -> None:
        s = self.session
        if not s.messages and untitled(s.title):
            s.title = title_from(text)
            self.app.store.update_session(s)
            self.refresh_header()
        self._start(self.agent.send(text))

    def _start(self, work, take_back: bool = True, turns: bool = True) -> None:
        """A run of the agent: the tool choices /tool-choice set for it, else free (`turns`
        False: a run without model turns of its own, /compact)."""
        if turns:
            self.agent.tool_choices, self.next_choices = self.next_choices or [ToolChoice()], None
        self._starting = True
        self.run_worker(self.run_agent(work, take_back), group="agent", exit_on_error=False)

    def warn_without_tool_format(self) -> None:
        """Tools on a model whose chat template has no tool-call format of its own: said,
        once per session, since small models call tools poorly that way."""
        s, built = self.session, self.app.host.built  # None while a switch loads a model
        if s.agent_type == "chat" or s.backend_url or built is None:
            return
        if (
            format_of(built.engine.tokenizer.chat_template).name != "generic"
            or s.id in self.app.warned_tools
        ):
            return
        self.app.warned_tools.add(s.id)
        self.app.notify(
            f"{built.loaded.name} has no tool-call format of its own: its tools are "
            "described in the system prompt and its calls held to a grammar.",
            severity="warning",
            timeout=8,
        )

    # -- the agent --------------------------------------------------------------------------

    @property
    def agent(self) -> AgentSession:
        return self.app.agents.session(self.session)

    def start_reply(self) -> None:
        """The agent works from the conversation as it stands."""
        self._start(self.agent.run())

    async def run_agent(self, work, take_back: bool = True) -> None:
        agent = self.agent
        session = agent.record  # the pane may show another session by the time it ends
        self._take_back = take_back
        try:
            task = asyncio.ensure_future(work)
            await asyncio.sleep(0)  # the run has begun: the agent itself says it is running
        finally:
            self._starting = False
        result = await task
        if result.status == "error":
            self.app.notify(f"{session.title}: {result.error}", severity="error", timeout=6)
        messages = session.messages
        if (
            result.status == "cancelled"
            and self._take_back  # Esc, not a pane closing
            and self.is_attached
            and self.session is session
            and agent.parent is None
            and len(messages) >= 2
            and messages[-1].role == "assistant"
            and not messages[-1].content
            and not messages[-1].tool_calls
            and messages[-2].role == "user"
        ):
            # Stopped before a word: take the question back into the input, as if unsent.
            store = self.app.store
            store.drop_last_message(session)
            last = session.messages[-1].content
            store.drop_last_message(session)
            await self.show_session(session)
            self.query_one(ChatInput).text = last
        self.post_message(SessionsChanged())
        if self.session is session:
            self.measure_context()
            await self.after_run(result.status)

    async def on_agent_update(self, message: AgentUpdate) -> None:
        """What the agent of the shown session did; the screen forwards every update. A pane
        (or a view) taken down meanwhile, between any two steps, is let be."""
        if message.event.session.id != self.session.id or self.gone:
            return  # another session's, or closing, or the app is quitting
        try:
            await self.show_update(message.event)
        except NoMatches:
            if not self.gone:
                raise

    def stop(self, take_back: bool = True) -> bool:
        """Esc: cancel this pane's agent (a child shown here: that child alone, with its own
        children); a reply stopped before its first word gives its question back to the
        input unless `take_back` is False (the pane is closing). True if something ran."""
        agent = self.app.agents.live.get(self.session.id)
        if agent is None or not agent.running:
            return False
        self._take_back = self._take_back and take_back
        agent.cancel()
        return True

    async def regenerate(self) -> None:
        """Ctrl+R: a new reply to the last message; the one it replaces is set aside, and
        /undo brings it back."""
        if self.busy:
            self.app.notify("Still answering; Esc stops it first.", severity="warning")
            return
        messages = self.session.messages
        if not messages or messages[-1].role == "user":
            self.app.notify("Nothing to regenerate yet.", severity="warning")
            return
        self.app.store.set_aside_reply(self.session)  # the reply and its tool calls
        await self.show_session(self.session)
        self.start_reply()
        self.app.notify("Regenerating; /undo brings the previous reply back.")

    def start_compact(self, focus: str) -> None:
        """/compact [focus]: the conversation but its last exchange summarized now."""
        if self.busy:
            raise ValueError("still answering; Esc stops it first")
        self._start(self.agent.compact(focus), take_back=False, turns=False)

    def continue_reply(self) -> None:
        """/continue: the last reply, cut short, written on from where it stopped."""
        if self.busy:
            raise ValueError("still answering; Esc stops it first")
        if self.agent.continuable() is None:
            raise ValueError("the last message is not a reply to continue")
        self._start(self.agent.continue_reply(), take_back=False)

    async def undo_regenerate(self) -> None:
        if self.busy:
            raise ValueError("still answering; Esc stops it first")
        if not self.app.store.undo_set_aside(self.session):
            raise ValueError("no reply was replaced here (Ctrl+R replaces one)")
        await self.show_session(self.session)

    def last_reply(self) -> str | None:
        replies = [m.content for m in self.session.messages if m.role == "assistant"]
        replies = [r for r in replies if r]
        return replies[-1] if replies else None

    def export(self) -> Path:
        folder = export_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{slug(self.session.title)}-{self.session.id}.md"
        path.write_text(export_markdown(self.session))
        return path

    # -- subagents --------------------------------------------------------------------------

    def start_fanout(self, count: int, task: str) -> None:
        if (built := self.app.host.built) is None:  # a switch loads another model
            raise ValueError("a model is loading; try again once it runs")
        slots = built.engine.max_slots
        children = self.agent.runtime.limits.max_children
        if not task:
            raise ValueError("say what the subagents should do: /fanout N <task>")
        if not 1 <= count <= min(slots, children):
            why = (
                f"one turn starts at most {children} subagents (the engine has {slots} slots)"
                if children <= slots
                else f"the engine has {slots} slots"
            )
            raise ValueError(f"N must be between 1 and {min(slots, children)}: {why}")
        if self.busy:
            raise ValueError("this pane is still answering; Esc stops it")
        self._start(self.agent.fanout(count, task), take_back=False)
