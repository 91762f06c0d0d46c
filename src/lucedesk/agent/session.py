"""An agent session: the loop model turn → tool calls → tool results → model turn, until a
final answer, the step limit, or cancel. A child (a subagent started by the `task` tool) is
an agent session like any other: its own stored session with a parent id, its own messages,
its own engine request per turn. Running the calls is tool_runner's part; starting children
and /fanout, children's.

Everything is written to the store as it happens: the user message, the reply as it grows
(at most once a second) and when it ends, each tool call when it starts and its result when
it ends, and the session's status.

Cancel is explicit: `cancel()` marks the session and its children cancelled and cancels the
task running each; a cancelled child's parent goes on, the task's result an error saying so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import lucedesk.agent.children as child_sessions
from lucedesk.agent import compactor
from lucedesk.agent.agent_types import type_named
from lucedesk.agent.compaction import Policy
from lucedesk.agent.events import (
    ChildStarted,
    MessageAdded,
    MessageDone,
    PhaseChanged,
    ReasoningStreamed,
    TextStreamed,
)
from lucedesk.agent.runtime import AgentResult, Runtime
from lucedesk.agent.tool_runner import run_calls
from lucedesk.agent.tools import ToolSpec, tools_for
from lucedesk.agent.workspace import Workspace
from lucedesk.chat import ChatMessage, Sampling, Tool, ToolChoice, TurnRequest, TurnResult
from lucedesk.engine import Grammar
from lucedesk.errors import RequestError
from lucedesk.store import Session, Store, StoredMessage

log = logging.getLogger(__name__)

SAVE_EVERY_S = 1.0  # how often a growing reply is written to the store


class AgentSession:
    def __init__(
        self,
        runtime: Runtime,
        record: Session,
        depth: int = 0,
        parent: AgentSession | None = None,
        tool_choices: list[ToolChoice] | None = None,
    ) -> None:
        self.runtime = runtime
        self.record = record
        self.depth = depth
        self.parent = parent
        # The tool choice of each model turn of a run; the last one holds for the rest.
        self.tool_choices = tool_choices or [ToolChoice()]
        self.children: list[AgentSession] = []
        self.phase = "idle"
        self._cancelled = False
        self._task: asyncio.Task | None = None

    # -- state ------------------------------------------------------------------------------

    @property
    def id(self) -> int:
        return self.record.id

    @property
    def title(self) -> str:
        return self.record.title

    @property
    def store(self) -> Store:
        return self.runtime.store

    @property
    def owner(self) -> str:
        """The engine slot owner of this session's requests (the slot monitor shows it)."""
        return f"agent{self.id}:{self.title[:16]}"

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def workspace(self) -> Workspace | None:
        return Workspace(self.record.workspace) if self.record.workspace else None

    def tools(self) -> list[ToolSpec]:
        agent_type = self.record.agent_type if self.record.workspace else "chat"
        can_spawn = self.depth < self.runtime.limits.max_depth
        return tools_for(agent_type, self.runtime.extra_tools, can_spawn)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def set_phase(self, phase: str, status: str | None = None) -> None:
        self.phase = phase
        if status is not None and status != self.record.status:
            self.store.set_status(self.record, status)
        self.runtime.emit(PhaseChanged(self))

    def cancel(self) -> None:
        """Stops this session and every child it started; the others of the tree go on."""
        self._cancelled = True
        for child in self.children:
            child.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    # -- the loop ---------------------------------------------------------------------------

    async def send(self, text: str) -> AgentResult:
        """A user message, then the loop until the final answer. A message larger than the
        context can ever hold beside the system prompt and tools is refused, not stored."""
        if (refusal := await self.refusal(text)) is not None:
            return AgentResult("error", "", refusal)
        message = self.store.add_message(self.record, StoredMessage("user", text))
        self.runtime.emit(MessageAdded(self, message))
        return await self.run()

    async def continue_reply(self) -> AgentResult:
        """The last reply, cut short (stopped, at max tokens, by a crash), written on from
        where it stopped, in the same message; then the loop goes on as after any turn."""
        last = self.continuable()
        if last is None:
            raise ValueError("the last message is not a reply cut short")
        return await self.run(continued=last)

    @property
    def policy(self) -> Policy:
        return self.runtime.limits.compaction

    async def refusal(self, text: str) -> str | None:
        """Why `text` cannot be sent as the next message (None: it can). Whatever else the
        session holds can be compacted; the system prompt, the tools and the message cannot."""
        backend = self.runtime.backend
        limit = await backend.context_limit()
        if limit is None:
            return None
        try:
            bare = replace(self.next_turn(), messages=self.model_messages(only_system=True))
            fixed = backend.prompt_tokens(bare)
            [tokens] = backend.count([text])
        except RequestError:  # no model runs now: the turn says so
            return None
        room = self.policy.message_room(fixed, limit)
        if tokens <= room:
            return None
        return (
            f"the message is {tokens:,} tokens; the context holds {limit:,}, and beside the "
            f"system prompt and tools one message can take at most {max(room, 0):,}"
        )

    async def context_use(self) -> tuple[int, int] | None:
        """The next turn's prompt as it stands and the context: (tokens, limit)."""
        backend = self.runtime.backend
        limit = await backend.context_limit()
        if limit is None:
            return None
        try:
            return backend.prompt_tokens(self.next_turn()), limit
        except RequestError:
            return None

    def next_turn(self) -> TurnRequest:
        """The next turn as it would be asked now (tools offered, the choice free)."""
        return self.turn_request(ToolChoice(), self.tools(), None)

    async def compact(self, focus: str = "") -> AgentResult:
        """`/compact [focus]`: the conversation but its last exchange summarized now."""

        async def work() -> AgentResult:
            self.set_phase("compacting", "running")
            limit = await self.runtime.backend.context_limit()
            if limit is None:
                raise ValueError(f"{self.runtime.backend.label} does not say its context")
            policy = Policy(recent=0.0, summary_tokens=self.policy.summary_tokens)
            marker = await compactor.compact(self, policy, limit, focus, by_hand=True)
            self.set_phase("done", "done")
            if marker is None:
                return AgentResult("error", "", "nothing to compact yet")
            return AgentResult("done", marker.content)

        return await self.guarded(work)

    def continuable(self) -> StoredMessage | None:
        """The last message, if it is a reply with text that a turn can write on from."""
        shown = [m for m in self.record.messages if m.role != "compaction"]
        last = shown[-1] if shown else None
        if last is None or last.role != "assistant" or not last.content.strip():
            return None
        return None if last.tool_calls else last

    async def run(self, continued: StoredMessage | None = None) -> AgentResult:
        """The loop, from the conversation as it stands (`continued`: the first turn writes on
        from that reply)."""

        async def start() -> AgentResult:
            if self._cancelled:
                raise asyncio.CancelledError
            self.set_phase("starting", "running")
            return await self._loop(continued)

        return await self.guarded(start)

    async def fanout(self, count: int, task: str, agent_type: str | None = None) -> AgentResult:
        """`/fanout N <task>`: N children work on N subtasks the model split the task into,
        then a last turn sums up (see children)."""
        return await child_sessions.fanout(self, count, task, agent_type)

    async def guarded(self, work: Callable[[], Awaitable[AgentResult]]) -> AgentResult:
        """`work` as this session's run: `cancel()` reaches it, and it ends with a result
        whatever happens (cancelled, or error for a bug or a broken setup)."""
        self._cancelled = self._cancelled and self._task is None  # a cancel before the run holds
        self._task = asyncio.current_task()
        try:
            return await work()
        except asyncio.CancelledError:
            return self._cancelled_result()
        except Exception as exc:  # a bug or a broken setup (a workspace gone): said, not raised
            return self._failed(exc)

    def _cancelled_result(self) -> AgentResult:
        """Inside `except CancelledError`: our own cancel ends the run with a result; anyone
        else's (the app exiting) goes on up, the session stored as cancelled either way."""
        self.set_phase("cancelled", "cancelled")
        if not self._cancelled:
            raise asyncio.CancelledError
        return AgentResult("cancelled", "", "cancelled")

    def _failed(self, exc: Exception) -> AgentResult:
        log.exception("agent session %s failed", self.id)
        self.set_phase("error", "error")
        return AgentResult("error", "", f"{type(exc).__name__}: {exc}")

    async def _loop(self, continued: StoredMessage | None = None) -> AgentResult:
        limits = self.runtime.limits
        for step in range(limits.max_steps):
            choice = self.tool_choices[min(step, len(self.tool_choices) - 1)]
            result = await self.model_turn(choice, continued=continued if step == 0 else None)
            if result.finish == "error":
                self.set_phase("error", "error")
                return AgentResult("error", result.text, result.error)
            if not result.calls:
                self.set_phase("done", "done")
                return AgentResult("done", result.text)
            await run_calls(self, result.calls)
        note = (
            f"Stopped: the step limit of {limits.max_steps} model turns was reached before a "
            "final answer."
        )
        message = self.store.add_message(self.record, StoredMessage("assistant", note))
        self.runtime.emit(MessageAdded(self, message))
        self.set_phase("step limit", "step_limit")
        return AgentResult("step_limit", note, note)

    def model_messages(self, only_system: bool = False) -> list[ChatMessage]:
        """The stored chat as the model reads it (compactions: the summary in place of what
        it covers), with the agent type's preamble in front of the system prompt when the
        session works in a folder; `only_system`: the system prompt alone."""
        messages = self.record.chat_messages()
        if only_system:
            messages = [m for m in messages[:1] if m.role == "system"]
        preamble = type_named(self.record.agent_type).prompt
        if self.workspace is None or not preamble:
            return messages
        if messages and messages[0].role == "system":
            first = ChatMessage("system", f"{preamble}\n\n{messages[0].content}")
            return [first, *messages[1:]]
        return [ChatMessage("system", preamble), *messages]

    def turn_request(
        self,
        choice: ToolChoice,
        tools: list[ToolSpec],
        response_format: Grammar | None,
        max_tokens: int | None = None,
    ) -> TurnRequest:
        """The next model turn: the conversation, the tools, the session's sampling."""
        s = self.record
        return TurnRequest(
            messages=self.model_messages(),
            tools=[Tool(t.name, t.description, t.parameters) for t in tools],
            tool_choice=choice if tools else ToolChoice(),
            # A forced turn makes one call: small models repeat a forced call to max_tokens.
            parallel_tool_calls=choice.mode == "auto",
            response_format=response_format,
            sampling=Sampling(
                max_tokens=max_tokens or s.max_tokens,
                temperature=s.temperature,
                top_p=0.95 if s.temperature else 1.0,
            ),
            interactive=self.runtime.watched is not None and self.runtime.watched(self),
        )

    async def model_turn(
        self,
        choice: ToolChoice,
        tools_on: bool = True,
        response_format: Grammar | None = None,
        max_tokens: int | None = None,
        continued: StoredMessage | None = None,
        split: int = 0,
    ) -> TurnResult:
        """One model turn into a new reply (`split`: it is a /fanout split into that many
        subtasks) or, `continued`, on from a reply cut short."""
        tools = self.tools() if tools_on else []
        if continued is not None:  # the text as the template keeps it (trailing space trimmed)
            continued.content = continued.content.rstrip()
        req = self.turn_request(choice, tools, response_format, max_tokens)
        req = await compactor.fit_request(self, req, self.policy)
        s = self.record
        if continued is None:
            reply = self.store.begin_reply(s, split)
            self.runtime.emit(MessageAdded(self, reply))
        else:
            req.continue_final = True
            reply = continued
            reply.reset_meta()
            self.store.update_reply(reply, reply.content, "streaming")
        before = reply.content
        self.set_phase("reading")  # queued, then the prompt is read (prefill)
        saved_at = time.monotonic()
        text: list[str] = []

        def on_text(piece: str) -> None:
            nonlocal saved_at
            if not text:
                self.set_phase("writing")
            text.append(piece)
            reply.content += piece
            self.runtime.emit(TextStreamed(self, reply, piece))
            if time.monotonic() - saved_at >= SAVE_EVERY_S:
                self.store.update_reply(reply, reply.content)
                saved_at = time.monotonic()

        def on_reasoning(piece: str) -> None:
            if not text:
                self.set_phase("thinking")
            reply.reasoning += piece
            self.runtime.emit(ReasoningStreamed(self, reply, piece))

        try:
            result = await self.runtime.backend.turn(req, self.owner, on_text, on_reasoning)
        except BaseException as exc:  # cancelled, or broken: keep what was written
            reply.split = 0  # shown as the text it got to, not as a split's progress
            if isinstance(exc, asyncio.CancelledError):
                reply.stopped = True
            else:
                reply.error = str(exc)
            self.store.update_reply(reply, reply.content, "done")
            self.runtime.emit(MessageDone(self, reply))
            raise
        # what streamed stays, also when the turn failed midway
        reply.reasoning = result.reasoning or reply.reasoning
        reply.tool_calls = list(result.calls)
        if result.finish == "error":
            reply.error = result.error
        elif result.finish == "length":
            reply.cut = True  # max tokens reached
        text = before + result.text if continued is not None else result.text
        self.store.update_reply(reply, text or reply.content, "done")
        self.runtime.emit(MessageDone(self, reply))
        return result

    # -- children ---------------------------------------------------------------------------

    async def run_child(self, description: str, prompt: str, agent_type: str) -> str:
        """The `task` tool: a child of type `agent_type` runs `prompt`; its final message."""
        return await child_sessions.run_child(self, description, prompt, agent_type)

    def adopt(self, record: Session) -> AgentSession:
        """The live session of a stored child of this one; cancelled already if this one is."""
        child = AgentSession(self.runtime, record, self.depth + 1, self)
        self.children.append(child)
        if self._cancelled:
            child._cancelled = True
        self.runtime.emit(ChildStarted(self, child))
        return child
