"""A chat pane: one session's conversation (a chat, an agent with tools, or a subagent
opened from the sidebar), its input, and its agent's live work: replies streaming in, tool
calls as compact blocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import platformdirs
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label

from lucedesk.agent import (
    AgentSession,
    MessageAdded,
    MessageDone,
    PhaseChanged,
    ReasoningStreamed,
    TextStreamed,
)
from lucedesk.store import Session, export_markdown
from lucedesk.tui.messages import AgentUpdate, PromptSubmitted, SessionsChanged
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.message_view import MessageView
from lucedesk.tui.widgets.tool_call_view import ToolCallView

HELP = (
    "Commands: /fanout N <task> · /tools on|read|off · /system <prompt> · /temp <0-2> · "
    "/max <tokens> · "
    "/title <name> · /backend <url|local> · /model <path> · /help"
)


def number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


class ChatPane(Vertical, can_focus=False):
    DEFAULT_CSS = """
    ChatPane { width: 1fr; border: round $panel; }
    ChatPane:focus-within { border: round $accent; }
    ChatPane > #header { height: 1; padding: 0 1; color: $text-muted; }
    ChatPane > #log { height: 1fr; padding: 0 1; }
    """

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session
        self.views: dict[int, MessageView | ToolCallView] = {}  # by stored message id
        self._starting = False  # a run is on its way to the agent (busy before it starts)
        self._take_back = True  # a run stopped before a word puts its question back

    def compose(self) -> ComposeResult:
        yield Label(self.header_text(), id="header")
        yield VerticalScroll(id="log")
        yield ChatInput(id="input")

    async def on_mount(self) -> None:
        self.query_one("#log", VerticalScroll).anchor()
        await self.show_session(self.session)

    # -- state ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._starting or self.app.agents.running(self.session.id)

    def header_text(self) -> str:
        s = self.session
        kind = "subagent · " if s.kind == "subagent" else ""
        tools = "no tools" if s.agent_type == "chat" else f"{s.agent_type} tools"
        system = " · system prompt set" if s.system_prompt and s.kind != "subagent" else ""
        backend = f" · via {s.backend_url}" if s.backend_url else ""
        agent = self.app.agents.live.get(s.id)
        phase = f" · {agent.phase}" if agent is not None and agent.running else ""
        return (
            f"{kind}{s.title} · {tools} · temp {s.temperature:g} · max {s.max_tokens}"
            f"{system}{backend}{phase}"
        )

    def refresh_header(self) -> None:
        self.query_one("#header", Label).update(self.header_text())

    async def show_session(self, session: Session) -> None:
        live = self.app.agents.live.get(session.id)
        self.session = live.record if live is not None else session  # a running child's own
        log = self.query_one("#log", VerticalScroll)
        await log.remove_children()
        self.views = {}
        views = [self.view_for(m) for m in self.session.messages]
        await log.mount_all([v for v in views if v is not None])
        self.refresh_header()

    def view_for(self, m: dict) -> MessageView | ToolCallView | None:
        """The widget of one stored message (remembered by id, so updates find it)."""
        if m["role"] == "tool":
            view = ToolCallView(m)
        elif m["role"] == "assistant" and not m["content"] and m["meta"].get("tool_calls"):
            if m.get("status") != "streaming":
                return None  # its calls follow, each in its own block
            view = MessageView("assistant")
        else:
            title = f"{m['role']} · interrupted" if m.get("status") == "interrupted" else None
            reasoning = (m.get("meta") or {}).get("reasoning", "")
            view = MessageView(m["role"], m["content"], title=title, reasoning=reasoning)
        if "id" in m:
            self.views[m["id"]] = view
        return view

    def focus_input(self) -> None:
        self.query_one(ChatInput).focus()

    # -- input ------------------------------------------------------------------------------

    async def on_prompt_submitted(self, message: PromptSubmitted) -> None:
        message.stop()
        text = message.text.strip()
        if not text:
            self.app.notify("Type a message first.", severity="warning")
            return
        if self.busy:
            self.app.notify("This pane is still answering; Esc stops it.", severity="warning")
            return
        if text.startswith("/"):
            if await self.run_command(text):
                self.query_one(ChatInput).clear()
            return
        self.query_one(ChatInput).clear()
        await self.send(text)

    async def send(self, text: str) -> None:
        self._starting = True
        self.run_worker(self.run_agent(self.agent.send(text)), group="agent", exit_on_error=False)

    async def run_command(self, line: str) -> bool:
        """A slash command; False (and a notice) when it is not understood."""
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        s = self.session
        try:
            if name == "fanout":
                count, _, task = rest.partition(" ")
                self.start_fanout(number(int, count), task.strip())
            elif name == "tools":
                modes = {"off": "chat", "read": "explore", "on": "general"}
                if rest not in modes:
                    raise ValueError("/tools on (every tool), read (read-only) or off")
                s.agent_type = modes[rest]
                s.workspace = s.workspace or str(self.app.workspace)
                self.app.notify(
                    f"Tools {rest} for this session"
                    + (f" in {s.workspace}." if rest != "off" else ".")
                )
            elif name == "system":
                s.system_prompt = rest
                self.app.notify("System prompt set." if rest else "System prompt cleared.")
            elif name == "temp":
                value = number(float, rest)
                if not 0.0 <= value <= 2.0:
                    raise ValueError("the temperature must be between 0 and 2")
                s.temperature = value
            elif name == "max":
                value = number(int, rest)
                if value < 1:
                    raise ValueError("max tokens must be at least 1")
                s.max_tokens = value
            elif name == "title":
                if not rest:
                    raise ValueError("give the session a name: /title <name>")
                s.title = rest[:60]
                self.post_message(SessionsChanged())
            elif name == "backend":
                if rest in ("", "local"):
                    s.backend_url = ""
                elif rest.startswith(("http://", "https://")):
                    s.backend_url = rest.rstrip("/")
                else:
                    raise ValueError("give an http(s) URL of an OpenAI-compatible server, or local")
                self.app.notify(f"This session now talks to {s.backend_url or 'the local engine'}.")
            elif name == "model":
                if not rest:
                    raise ValueError("give a .gguf file or a Hugging Face folder")
                self.app.switch_model(rest)
            elif name == "help":
                self.app.notify(HELP, timeout=8)
            else:
                self.app.notify(f"Unknown command /{name}. {HELP}", severity="error", timeout=6)
                return False
        except ValueError as exc:
            self.app.notify(f"/{name}: {exc}", severity="error")
            return False
        self.app.store.update_session(s)
        self.refresh_header()
        return True

    # -- the agent --------------------------------------------------------------------------

    @property
    def agent(self) -> AgentSession:
        return self.app.agents.session(self.session)

    def start_reply(self) -> None:
        """The agent works from the conversation as it stands."""
        self._starting = True
        self.run_worker(self.run_agent(self.agent.run()), group="agent", exit_on_error=False)

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
            and messages[-1]["role"] == "assistant"
            and not messages[-1]["content"]
            and not messages[-1]["meta"].get("tool_calls")
            and messages[-2]["role"] == "user"
        ):
            # Stopped before a word: take the question back into the input, as if unsent.
            store = self.app.store
            store.drop_last_message(session)
            last = session.messages[-1]["content"]
            store.drop_last_message(session)
            await self.show_session(session)
            self.query_one(ChatInput).text = last
        self.post_message(SessionsChanged())

    async def on_agent_update(self, message: AgentUpdate) -> None:
        """What the agent of the shown session did; the screen forwards every update."""
        event = message.event
        if event.session.id != self.session.id:
            return
        if isinstance(event, PhaseChanged):
            self.refresh_header()
        elif isinstance(event, MessageAdded):
            if event.message["id"] in self.views:
                return  # shown already: the pane opened after the message was added
            view = self.view_for(event.message)
            if view is not None:
                await self.query_one("#log").mount(view)
        elif isinstance(event, TextStreamed):
            view = self.views.get(event.message["id"])
            if isinstance(view, MessageView):
                # Only what the view lacks: one opened mid-reply showed the text so far.
                missing = event.message["content"][len(view.content) :]
                if missing:
                    await view.append(missing)
        elif isinstance(event, ReasoningStreamed):
            view = self.views.get(event.message["id"])
            if isinstance(view, MessageView):
                await view.show_reasoning(event.message["meta"].get("reasoning", ""))
        elif isinstance(event, MessageDone):
            view = self.views.get(event.message["id"])
            if isinstance(view, ToolCallView):
                view.update_call(event.message)
            elif isinstance(view, MessageView):
                meta = event.message.get("meta") or {}
                note = "stopped" if meta.get("stopped") else None
                note = "max tokens" if meta.get("cut") else note
                note = f"error: {meta['error']}" if meta.get("error") else note
                await view.finish(note)
                if event.message["content"] and view.content != event.message["content"]:
                    await view.replace(event.message["content"])
                if meta.get("reasoning"):
                    await view.show_reasoning(meta["reasoning"])
                if not view.content and not meta.get("reasoning") and meta.get("tool_calls"):
                    await view.remove()  # the calls follow, each in its own block

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
        if self.busy:
            self.app.notify("Still answering; Esc stops it first.", severity="warning")
            return
        messages = self.session.messages
        if not messages or messages[-1]["role"] == "user":
            self.app.notify("Nothing to regenerate yet.", severity="warning")
            return
        while self.session.messages and self.session.messages[-1]["role"] != "user":
            self.app.store.drop_last_message(self.session)  # the reply and its tool calls
        await self.show_session(self.session)
        self.start_reply()

    def last_reply(self) -> str | None:
        replies = [m["content"] for m in self.session.messages if m["role"] == "assistant"]
        replies = [r for r in replies if r]
        return replies[-1] if replies else None

    def export(self) -> Path:
        folder = Path(platformdirs.user_documents_dir()) / "lucedesk"
        folder.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_ " else "_" for c in self.session.title)
        path = folder / f"{safe.strip() or 'session'}-{self.session.id}.md"
        path.write_text(export_markdown(self.session))
        return path

    # -- subagents --------------------------------------------------------------------------

    def start_fanout(self, count: int, task: str) -> None:
        slots = min(self.app.host.engine.max_slots, self.agent.runtime.limits.max_children)
        if not task:
            raise ValueError("say what the subagents should do: /fanout N <task>")
        if not 1 <= count <= slots:
            raise ValueError(f"N must be between 1 and the engine's {slots} slots")
        if self.busy:
            raise ValueError("this pane is still answering; Esc stops it")
        self._starting = True
        self.run_worker(
            self.run_agent(self.agent.fanout(count, task), take_back=False),
            group="agent",
            exit_on_error=False,
        )
