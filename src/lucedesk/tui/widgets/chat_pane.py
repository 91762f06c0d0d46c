"""A chat pane: one session's conversation, its input, its running reply or fan-out."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import platformdirs
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label

from lucedesk.engine import FinishReason, RequestError, RequestHandle, SamplingParams
from lucedesk.store import Session, export_markdown
from lucedesk.tui.messages import PromptSubmitted, SessionsChanged
from lucedesk.tui.remote import RemoteHandle
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.message_view import MessageView

SAVE_EVERY_S = 1.0  # how often a growing reply is written to the store

HELP = (
    "Commands: /fanout N <task> · /system <prompt> · /temp <0-2> · /max <tokens> · "
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
    ChatPane > #subagents { height: auto; max-height: 50%; display: none;
                            border-top: dashed $warning; padding: 0 1; }
    ChatPane > #subagents.active { display: block; }
    """

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session
        self.handles: list[RequestHandle | RemoteHandle] = []

    def compose(self) -> ComposeResult:
        yield Label(self.header_text(), id="header")
        yield VerticalScroll(id="log")
        yield VerticalScroll(id="subagents")
        yield ChatInput(id="input")

    async def on_mount(self) -> None:
        self.query_one("#log", VerticalScroll).anchor()
        await self.show_session(self.session)

    # -- state ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return any(not h.finished for h in self.handles)

    def header_text(self) -> str:
        s = self.session
        system = " · system prompt set" if s.system_prompt else ""
        backend = f" · via {s.backend_url}" if s.backend_url else ""
        return f"{s.title} · temp {s.temperature:g} · max {s.max_tokens}{system}{backend}"

    def refresh_header(self) -> None:
        self.query_one("#header", Label).update(self.header_text())

    async def show_session(self, session: Session) -> None:
        self.session = session
        log = self.query_one("#log", VerticalScroll)
        await log.remove_children()
        views = []
        for m in session.messages:
            interrupted = m.get("status") == "interrupted"
            title = f"{m['role']} · interrupted" if interrupted else None
            views.append(MessageView(m["role"], m["content"], title=title))
        await log.mount_all(views)
        self.refresh_header()

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
        self.app.store.add_message(self.session, "user", text)
        await self.query_one("#log").mount(MessageView("user", text))
        self.start_reply()

    async def run_command(self, line: str) -> bool:
        """A slash command; False (and a notice) when it is not understood."""
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        s = self.session
        try:
            if name == "fanout":
                count, _, task = rest.partition(" ")
                self.start_fanout(number(int, count), task.strip())
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

    # -- generation -------------------------------------------------------------------------

    def params(self, prompt_len: int, engine) -> SamplingParams:
        s = self.session
        return SamplingParams(
            max_tokens=min(s.max_tokens, engine.output_room(prompt_len, None)),
            temperature=s.temperature,
            top_p=0.95 if s.temperature else 1.0,
        )

    def submit(self, messages: list[dict], owner: str) -> RequestHandle | RemoteHandle | None:
        if self.session.backend_url:
            s = self.session
            params = SamplingParams(
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=0.95 if s.temperature else 1.0,
            )
            handle = RemoteHandle(s.backend_url, messages, params, owner).start()
            self.handles.append(handle)
            return handle
        engine = self.app.host.engine
        try:
            prompt = engine.encode_chat(messages).token_ids
            handle = engine.submit(prompt, self.params(len(prompt), engine), owner=owner)
        except RequestError as exc:
            self.app.notify(f"Cannot send: {exc}", severity="error", timeout=6)
            return None
        self.handles.append(handle)
        return handle

    def start_reply(self) -> None:
        handle = self.submit(self.session.chat_messages(), owner=f"pane:{self.session.title[:18]}")
        if handle is not None:
            self.run_worker(self.stream_reply(handle), group="reply")

    async def stream_reply(self, handle: RequestHandle | RemoteHandle) -> None:
        view = MessageView("assistant")
        await self.query_one("#log").mount(view)
        store = self.app.store
        reply = store.begin_reply(self.session)
        reason, error = await self._pump(handle, view, reply)
        if reason is FinishReason.CANCELLED and not view.content:
            # Stopped before a word: take the question back into the input, as if unsent.
            await view.remove()
            store.drop_last_message(self.session)  # the empty reply
            last = self.session.messages[-1]["content"] if self.session.messages else ""
            store.drop_last_message(self.session)
            await self.show_session(self.session)
            self.query_one(ChatInput).text = last
            return
        note = {
            FinishReason.CANCELLED: "stopped",
            FinishReason.LENGTH: "max tokens",
            FinishReason.ERROR: f"error: {error}",
        }.get(reason)
        await view.finish(note)
        store.update_reply(reply, view.content, status="done")

    async def _pump(
        self, handle: RequestHandle | RemoteHandle, view: MessageView, reply: dict | None = None
    ):
        """Streams `handle` into `view`; saves the text so far into the stored `reply` at
        most once a second."""
        reason, error = FinishReason.ERROR, "no output"
        saved_at = time.monotonic()
        async for first in handle:
            # Everything that arrived while the last render ran goes into one update.
            burst = [first, *handle.take_ready()]
            text = "".join(out.text for out in burst)
            if text:
                await view.append(text)
                if reply is not None and time.monotonic() - saved_at >= SAVE_EVERY_S:
                    self.app.store.update_reply(reply, view.content)
                    saved_at = time.monotonic()
            if burst[-1].finished:
                reason, error = burst[-1].finish_reason, burst[-1].error
                break
        return reason, error

    def stop(self) -> bool:
        """Esc: cancel the running reply or fan-out. True if something was running."""
        running = [h for h in self.handles if not h.finished]
        for h in running:
            h.cancel()
        return bool(running)

    async def regenerate(self) -> None:
        if self.busy:
            self.app.notify("Still answering; Esc stops it first.", severity="warning")
            return
        if not self.session.messages or self.session.messages[-1]["role"] != "assistant":
            self.app.notify("Nothing to regenerate yet.", severity="warning")
            return
        self.app.store.drop_last_message(self.session)
        await self.show_session(self.session)
        self.start_reply()

    def last_reply(self) -> str | None:
        replies = [m["content"] for m in self.session.messages if m["role"] == "assistant"]
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
        slots = self.app.host.engine.max_slots
        if not task:
            raise ValueError("say what the subagents should do: /fanout N <task>")
        if not 1 <= count <= slots:
            raise ValueError(f"N must be between 1 and the engine's {slots} slots")
        self.run_worker(self.fanout(count, task), group="fanout")

    async def fanout(self, count: int, task: str) -> None:
        """N subagents, each a session of its own starting from this conversation plus its
        own instruction, run at once in separate slots; their answers come back here as one
        message the conversation continues from."""
        parent, store = self.session, self.app.store
        panel = self.query_one("#subagents", VerticalScroll)
        await panel.remove_children()
        panel.add_class("active")
        runs = []
        subs = []
        with store.transaction():  # the children land together, each with its task
            for i in range(count):
                sub = store.create_session(
                    f"{parent.title} · subagent {i + 1}/{count}",
                    kind="subagent",
                    parent_id=parent.id,
                    system_prompt=parent.system_prompt,
                    temperature=parent.temperature,
                    max_tokens=parent.max_tokens,
                )
                for m in parent.messages:
                    store.add_message(sub, m["role"], m["content"])
                store.add_message(
                    sub,
                    "user",
                    f"{task}\n\n(You are subagent {i + 1} of {count}; "
                    "work on this independently and answer in full.)",
                )
                subs.append((sub, store.begin_reply(sub)))
        for i, (sub, reply) in enumerate(subs):
            handle = self.submit(sub.chat_messages(), owner=f"sub{i + 1}:{parent.title[:14]}")
            if handle is None:
                break
            view = MessageView("assistant", title=f"subagent {i + 1}/{count}")
            await panel.mount(view)
            runs.append((sub, reply, handle, view))
        results = await asyncio.gather(*(self._pump(h, v, r) for _, r, h, v in runs))
        parts = []
        for (_sub, reply, _, view), (reason, _error) in zip(runs, results):
            await view.finish()
            store.update_reply(reply, view.content, status="done")
            status = "" if reason in (FinishReason.STOP, FinishReason.LENGTH) else f" ({reason})"
            parts.append(f"### Subagent {len(parts) + 1}{status}\n\n{view.content.strip()}")
        panel.remove_class("active")
        await panel.remove_children()
        if not parts:
            return
        with store.transaction():
            store.add_message(parent, "user", f"Fan-out to {count} subagents: {task}")
            store.add_message(parent, "assistant", "\n\n".join(parts))
        await self.show_session(parent)
        self.post_message(SessionsChanged())
