"""The TUI's side of agent sessions: one runtime per backend, the live AgentSession of each
stored session, approvals asked in a dialog, and agent events posted to the screen that
shows them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from lucedesk.agent import (
    AgentEvent,
    AgentSession,
    ApprovalRequest,
    Approvals,
    ChildStarted,
    EngineBackend,
    Limits,
    OpenAIBackend,
    ReasoningStreamed,
    Runtime,
    TextStreamed,
)
from lucedesk.store import Session
from lucedesk.tui.messages import AgentUpdate

FLUSH_S = 0.1

if TYPE_CHECKING:
    from textual.app import App

    from lucedesk.engine import Engine
    from lucedesk.store import Store


class AgentRunner:
    """The app's agent sessions: made from stored sessions, run on `engine()` (the one the
    app holds now) or a remote backend, saved in `store`; their approvals and split reviews
    asked as dialogs on `app`."""

    def __init__(
        self,
        app: App,
        store: Store,
        engine: Callable[[], Engine],
        approvals: Approvals,
        limits: Limits,
    ) -> None:
        self.app = app
        self.limits = limits
        self.store = store
        self.engine = engine
        self.approvals = approvals
        self.approvals.ask = self.ask
        self.approvals.review_split = self.review_split
        self.extra_tools: list = []  # MCP servers' tools, once started
        self.live: dict[int, AgentSession] = {}  # by stored session id
        # Where agent events go and which session the user watches: the main screen's,
        # once it is mounted (show_on); until then events go nowhere and none is watched.
        self._post: Callable[[AgentUpdate], bool] = lambda update: False
        self._watched_id: Callable[[], int | None] = lambda: None
        # streamed text (and reasoning) not yet handed on, by reply and kind
        self._held: dict[tuple[int, type], TextStreamed | ReasoningStreamed] = {}
        self._flush_at: asyncio.TimerHandle | None = None
        self.runtimes: dict[str, Runtime] = {}
        self._asking = asyncio.Lock()  # one approval dialog at a time

    def show_on(
        self, post: Callable[[AgentUpdate], bool], watched_id: Callable[[], int | None]
    ) -> None:
        """Agent events are posted with `post`; `watched_id` says the id of the session the
        user is watching (the focused pane's), or None."""
        self._post, self._watched_id = post, watched_id

    def runtime(self, backend_url: str) -> Runtime:
        runtime = self.runtimes.get(backend_url)
        if runtime is None:
            backend = OpenAIBackend(backend_url) if backend_url else EngineBackend(self.engine)
            runtime = Runtime(
                backend,
                self.store,
                self.approvals,
                self.extra_tools,
                self.observe,
                self.limits,
                watched=self.watched,
            )
            self.runtimes[backend_url] = runtime
        return runtime

    def session(self, record: Session) -> AgentSession:
        """The live agent of a stored session (made on first use, and again, between runs,
        when the session was sent to another backend: /backend)."""
        agent = self.live.get(record.id)
        runtime = self.runtime(record.backend_url)
        if agent is None or (
            not agent.running and (agent.record is not record or agent.runtime is not runtime)
        ):
            # A subagent continued after a restart keeps its depth: the limit still holds.
            depth, parent_id = 0, record.parent_id
            while parent_id is not None and depth < 64:
                parent = self.store.session(parent_id)
                parent_id = parent.parent_id if parent is not None else None
                depth += 1
            agent = AgentSession(runtime, record, depth)
            self.live[record.id] = agent
        return agent

    def watched(self, agent: AgentSession) -> bool:
        """The session the focused pane shows is the one being watched: its turns keep their
        pace beside subagents and other panes (the slot monitor marks it »)."""
        return self._watched_id() == agent.id

    def running(self, session_id: int) -> bool:
        agent = self.live.get(session_id)
        return agent is not None and agent.running

    def observe(self, event: AgentEvent) -> None:
        """Called for every agent event: hands it to the main screen. Streamed text is
        gathered and handed on FLUSH_S later in one piece per reply (a reply renders at
        most six times a second anyway; a message per token cost the engine's cores)."""
        if isinstance(event, ChildStarted):
            self.live[event.child.id] = event.child
        if isinstance(event, TextStreamed | ReasoningStreamed):
            key = (event.message.id, type(event))
            held = self._held.get(key)
            text = held.text + event.text if held is not None else event.text
            self._held[key] = type(event)(event.session, event.message, text)
            if self._flush_at is None:
                self._flush_at = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
            return
        self.flush()  # what was streamed goes first: events keep their order
        self.post(event)

    def flush(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        held, self._held = self._held, {}
        for event in held.values():
            self.post(event)

    def post(self, event: AgentEvent) -> None:
        self._post(AgentUpdate(event))

    async def ask(self, request: ApprovalRequest) -> bool:
        from lucedesk.tui.screens.approval import ApprovalDialog

        async with self._asking:
            answered: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            self.app.push_screen(ApprovalDialog(request), answered.set_result)
            choice = await answered
        if choice == "always":
            if request.kind == "edit":
                self.approvals.allow_edits = True
            else:
                self.approvals.allow_commands = True
        return choice in ("once", "always")

    async def review_split(self, session_title: str, subtasks: list[dict]) -> list[dict] | None:
        from lucedesk.tui.screens.dialogs import SplitDialog

        async with self._asking:
            answered: asyncio.Future[list[dict] | None] = asyncio.get_running_loop().create_future()
            self.app.push_screen(SplitDialog(session_title, subtasks), answered.set_result)
            return await answered
