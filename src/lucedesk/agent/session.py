"""An agent session: the loop model turn → tool calls → tool results → model turn, until a
final answer, the step limit, or cancel. A child (a subagent started by the `task` tool) is
an agent session like any other: its own stored session with a parent id, its own messages,
its own engine request per turn.

Everything is written to the store as it happens: the user message, the reply as it grows
(at most once a second) and when it ends, each tool call when it starts and its result when
it ends, and the session's status.

Cancel is explicit: `cancel()` marks the session and its children cancelled and cancels the
task running each; a cancelled child's parent goes on, the task's result an error saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import jsonschema

from lucedesk.agent.approvals import Approvals
from lucedesk.agent.backend import Backend
from lucedesk.agent.events import (
    ChildStarted,
    MessageAdded,
    MessageDone,
    Observer,
    PhaseChanged,
    ReasoningStreamed,
    TextStreamed,
)
from lucedesk.agent.tools import ToolContext, ToolError, ToolSpec, tools_for
from lucedesk.agent.tools import task as task_tool
from lucedesk.agent.workspace import Workspace
from lucedesk.engine import Grammar, Tool, ToolCall, ToolChoice, TurnRequest, TurnResult
from lucedesk.store import Session, Store

log = logging.getLogger(__name__)

SAVE_EVERY_S = 1.0  # how often a growing reply is written to the store

AGENT_PROMPT = """\
You are an agent working in a workspace folder. Use the tools to look at files, search and \
(when asked) change them, one step at a time; tool paths are relative to the workspace \
('.' is its root). When you have what you need, answer in plain text."""

CHILD_PROMPT = """\
You are a subagent: another agent gave you the task in the next message. Work on it with \
your tools, then answer with one final message. The other agent reads only that message, \
so put every finding it needs in it."""

SUBTASK_TITLE_CHARS = 60  # the longest title and task a /fanout split may write
SUBTASK_CHARS = 400

SPLIT_PROMPT = """\
Split this task into {count} distinct, self-contained subtasks that can be worked on at the \
same time by {count} subagents who see nothing but their own subtask. Task: {task}"""


@dataclass(slots=True)
class Limits:
    max_steps: int = 30  # model turns in one run of the loop
    max_depth: int = 2  # children of children of a top-level session, no deeper
    max_children: int = 8  # task calls of one turn that run (the rest get an error)


@dataclass(slots=True)
class Runtime:
    """What every session of one tree shares."""

    backend: Backend
    store: Store
    approvals: Approvals = field(default_factory=Approvals)
    extra_tools: list[ToolSpec] = field(default_factory=list)  # MCP servers' tools
    observer: Observer | None = None
    limits: Limits = field(default_factory=Limits)
    # Whether someone watches a session now (the TUI: the one in the focused pane); its
    # model turns then keep their pace beside background work. None: nobody does.
    watched: Callable[[AgentSession], bool] | None = None

    def emit(self, event) -> None:
        if self.observer is not None:
            self.observer(event)


class AgentResult(NamedTuple):
    status: str  # done | step_limit | cancelled | error
    text: str
    error: str | None = None


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

    def _set_phase(self, phase: str, status: str | None = None) -> None:
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
        """A user message, then the loop until the final answer."""
        message = self.store.add_message(self.record, "user", text)
        self.runtime.emit(MessageAdded(self, message))
        return await self.run()

    async def continue_reply(self) -> AgentResult:
        """The last reply, cut short (stopped, at max tokens, by a crash), written on from
        where it stopped, in the same message; then the loop goes on as after any turn."""
        last = self.continuable()
        if last is None:
            raise ValueError("the last message is not a reply cut short")
        return await self.run(continued=last)

    def continuable(self) -> dict | None:
        """The last message, if it is a reply with text that a turn can write on from."""
        last = self.record.messages[-1] if self.record.messages else None
        if last is None or last["role"] != "assistant" or not last["content"].strip():
            return None
        return None if (last.get("meta") or {}).get("tool_calls") else last

    async def run(self, continued: dict | None = None) -> AgentResult:
        """The loop, from the conversation as it stands (`continued`: the first turn writes on
        from that reply)."""
        self._cancelled = self._cancelled and self._task is None  # a cancel before the run holds
        self._task = asyncio.current_task()
        try:
            if self._cancelled:
                raise asyncio.CancelledError
            self._set_phase("starting", "running")
            return await self._loop(continued)
        except asyncio.CancelledError:
            return self._cancelled_result()
        except Exception as exc:  # a bug or a broken setup (a workspace gone): said, not raised
            return self._failed(exc)

    def _cancelled_result(self) -> AgentResult:
        """Inside `except CancelledError`: our own cancel ends the run with a result; anyone
        else's (the app exiting) goes on up, the session stored as cancelled either way."""
        self._set_phase("cancelled", "cancelled")
        if not self._cancelled:
            raise asyncio.CancelledError
        return AgentResult("cancelled", "", "cancelled")

    def _failed(self, exc: Exception) -> AgentResult:
        log.exception("agent session %s failed", self.id)
        self._set_phase("error", "error")
        return AgentResult("error", "", f"{type(exc).__name__}: {exc}")

    async def _loop(self, continued: dict | None = None) -> AgentResult:
        limits = self.runtime.limits
        for step in range(limits.max_steps):
            choice = self.tool_choices[min(step, len(self.tool_choices) - 1)]
            result = await self._model_turn(choice, continued=continued if step == 0 else None)
            if result.finish == "error":
                self._set_phase("error", "error")
                return AgentResult("error", result.text, result.error)
            if not result.calls:
                self._set_phase("done", "done")
                return AgentResult("done", result.text)
            await self._run_calls(result.calls)
        note = (
            f"Stopped: the step limit of {limits.max_steps} model turns was reached before a "
            "final answer."
        )
        message = self.store.add_message(self.record, "assistant", note)
        self.runtime.emit(MessageAdded(self, message))
        self._set_phase("step limit", "step_limit")
        return AgentResult("step_limit", note, note)

    def model_messages(self) -> list[dict]:
        messages = self.record.chat_messages()
        workspace = self.workspace
        if workspace is None or self.record.agent_type == "chat":
            return messages
        preamble = AGENT_PROMPT
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": f"{preamble}\n\n{messages[0]['content']}"}] + (
                messages[1:]
            )
        return [{"role": "system", "content": preamble}, *messages]

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
            max_tokens=max_tokens or s.max_tokens,
            temperature=s.temperature,
            top_p=0.95 if s.temperature else 1.0,
            interactive=self.runtime.watched is not None and self.runtime.watched(self),
        )

    async def _model_turn(
        self,
        choice: ToolChoice,
        tools_on: bool = True,
        response_format: Grammar | None = None,
        max_tokens: int | None = None,
        continued: dict | None = None,
    ) -> TurnResult:
        tools = self.tools() if tools_on else []
        if continued is not None:  # the text as the template keeps it (trailing space trimmed)
            continued["content"] = continued["content"].rstrip()
        req = self.turn_request(choice, tools, response_format, max_tokens)
        s = self.record
        if continued is None:
            reply = self.store.begin_reply(s)
            self.runtime.emit(MessageAdded(self, reply))
        else:
            req.continue_final = True
            reply = continued
            self.store.update_reply(reply, reply["content"], "streaming", {})
        before = reply["content"]
        self._set_phase("reading")  # queued, then the prompt is read (prefill)
        saved_at = time.monotonic()
        text: list[str] = []

        def on_text(piece: str) -> None:
            nonlocal saved_at
            if not text:
                self._set_phase("writing")
            text.append(piece)
            reply["content"] += piece
            self.runtime.emit(TextStreamed(self, reply, piece))
            if time.monotonic() - saved_at >= SAVE_EVERY_S:
                self.store.update_reply(reply, reply["content"])
                saved_at = time.monotonic()

        def on_reasoning(piece: str) -> None:
            if not text:
                self._set_phase("thinking")
            reply["meta"]["reasoning"] = reply["meta"].get("reasoning", "") + piece
            self.runtime.emit(ReasoningStreamed(self, reply, piece))

        meta: dict = {}
        try:
            result = await self.runtime.backend.turn(req, self.owner, on_text, on_reasoning)
        except BaseException as exc:  # cancelled, or broken: keep what was written
            meta = (
                {"stopped": True}
                if isinstance(exc, asyncio.CancelledError)
                else {"error": str(exc)}
            )
            if reply["meta"].get("reasoning"):
                meta["reasoning"] = reply["meta"]["reasoning"]
            self.store.update_reply(reply, reply["content"], "done", meta)
            self.runtime.emit(MessageDone(self, reply))
            raise
        reasoning = result.reasoning or reply["meta"].get("reasoning", "")
        if reasoning:  # what streamed stays, also when the turn failed midway
            meta["reasoning"] = reasoning
        if result.calls:
            meta["tool_calls"] = [
                {"id": c.id, "name": c.name, "arguments": c.arguments} for c in result.calls
            ]
        if result.finish == "error":
            meta["error"] = result.error
        elif result.finish == "length":
            meta["cut"] = True  # max tokens reached
        text = before + result.text if continued is not None else result.text
        self.store.update_reply(reply, text or reply["content"], "done", meta)
        self.runtime.emit(MessageDone(self, reply))
        return result

    # -- tool calls -------------------------------------------------------------------------

    async def _run_calls(
        self, calls: list[ToolCall], specs: dict[str, ToolSpec] | None = None
    ) -> None:
        """Runs one turn's calls. Calls that only look (and task calls) run together; one that
        writes or runs something runs alone, in the order the model wrote them."""
        specs = specs if specs is not None else {t.name: t for t in self.tools()}
        pending = []
        for call in calls:
            meta = {"tool_call_id": call.id, "name": call.name, "arguments": call.arguments}
            message = self.store.add_message(self.record, "tool", "", "streaming", meta)
            self.runtime.emit(MessageAdded(self, message))
            pending.append((call, message))
        children = 0
        batch: list = []
        for call, message in pending:
            spec = specs.get(call.name)
            if spec is not None and spec.access == "task":
                children += 1
                if children > self.runtime.limits.max_children:
                    spec = None  # reported as too many below
            together = spec is not None and spec.access in ("read", "task")
            if not together and batch:
                await self._run_batch(batch)
                batch = []
            batch.append((call, message, spec))
            if not together:
                await self._run_batch(batch)
                batch = []
        if batch:
            await self._run_batch(batch)

    async def _run_batch(self, batch: list) -> None:
        names = ", ".join(call.name for call, _, _ in batch)
        self._set_phase(f"tool {names}" if len(batch) < 3 else f"{len(batch)} tools")
        await asyncio.gather(
            *(self._run_call(call, message, spec) for call, message, spec in batch)
        )

    async def _run_call(self, call: ToolCall, message: dict, spec: ToolSpec | None) -> None:
        meta = dict(message["meta"])
        try:
            text = await self._call(call, spec)
            meta["error"] = False
        except ToolError as exc:
            text, meta["error"] = f"error: {exc}", True
        except asyncio.CancelledError:
            meta["error"] = True
            self.store.update_reply(message, "cancelled", "done", meta)
            self.runtime.emit(MessageDone(self, message))
            raise
        except Exception as exc:  # a tool's own bug: the model and the log hear of it
            log.exception("tool %s failed", call.name)
            text, meta["error"] = f"error: the tool failed ({type(exc).__name__}: {exc})", True
        self.store.update_reply(message, text, "done", meta)
        self.runtime.emit(MessageDone(self, message))

    async def _call(self, call: ToolCall, spec: ToolSpec | None) -> str:
        if spec is None:
            names = ", ".join(t.name for t in self.tools()) or "none"
            if call.name == "task":
                raise ToolError(
                    f"too many task calls in one turn (at most {self.runtime.limits.max_children})"
                    if any(t.name == "task" for t in self.tools())
                    else "task: the depth limit is reached; do this work yourself"
                )
            raise ToolError(f"unknown tool {call.name!r}; the tools are: {names}")
        try:
            args = json.loads(call.arguments or "{}")
        except ValueError as exc:
            raise ToolError(f"arguments: not valid JSON ({exc})") from None
        problem = jsonschema.Draft202012Validator(spec.parameters).iter_errors(args)
        first = jsonschema.exceptions.best_match(problem)
        if first is not None:
            where = "/".join(str(p) for p in first.absolute_path) or "arguments"
            raise ToolError(f"{where}: {first.message} (the arguments of {spec.name})")
        workspace = self.workspace
        if workspace is None and spec.access != "task":
            raise ToolError("this session has no workspace")
        return await spec.handler(ToolContext(workspace, self.runtime.approvals, self), args)

    # -- children ---------------------------------------------------------------------------

    def new_child(self, description: str, agent_type: str) -> AgentSession:
        s = self.record
        if agent_type not in ("chat", "explore", "general"):  # chat: a /fanout without tools
            raise ToolError("agent_type: explore or general")
        if self.depth >= self.runtime.limits.max_depth:
            raise ToolError("task: the depth limit is reached; do this work yourself")
        if agent_type == "general" and s.agent_type == "explore":
            raise ToolError("agent_type: an explore agent can only start explore subagents")
        record = self.store.create_session(
            description.strip()[:60] or "subtask",
            kind="subagent",
            parent_id=s.id,
            system_prompt=CHILD_PROMPT,
            temperature=s.temperature,
            max_tokens=s.max_tokens,
            agent_type=agent_type,
            workspace=s.workspace,
            backend_url=s.backend_url,
        )
        child = AgentSession(self.runtime, record, self.depth + 1, self)
        self.children.append(child)
        if self._cancelled:
            child._cancelled = True
        self.runtime.emit(ChildStarted(self, child))
        return child

    async def run_child(self, description: str, prompt: str, agent_type: str) -> str:
        """The `task` tool: a child runs `prompt` in its own task (so cancelling it alone
        leaves this session running); its final message is the result."""
        child = self.new_child(description, agent_type)
        if self._cancelled:
            self.store.set_status(child.record, "cancelled")
            raise asyncio.CancelledError
        running = asyncio.create_task(child.send(prompt))
        try:
            result = await running
        except asyncio.CancelledError:
            if child.record.status == "idle":  # cancelled before it began: it never ran
                self.store.set_status(child.record, "cancelled")
            raise
        if result.status == "done":
            return result.text.strip() or "(the subagent answered with an empty message)"
        if result.status == "cancelled":
            raise ToolError("the subagent was cancelled before it finished")
        if result.status == "step_limit":
            raise ToolError(f"the subagent stopped at its step limit. {result.text}")
        raise ToolError(f"the subagent failed: {result.error}")

    async def fanout(self, count: int, task: str, agent_type: str | None = None) -> AgentResult:
        """`/fanout N <task>`: the model splits the task into N distinct subtasks (held to a
        JSON schema), N children work on them at once, and a last turn writes the synthesis
        from their results. The split is stored as N `task` calls, so the transcript reads
        like any other delegation."""
        if agent_type is None:  # children only look; a session without tools gives them none
            agent_type = "chat" if self.tools() == [] else "explore"
        # Shown as the user wrote it; the model reads the split prompt (see chat_messages).
        prompt = SPLIT_PROMPT.format(count=count, task=task)
        line = f"/fanout {count} {task}"
        message = self.store.add_message(self.record, "user", line, meta={"prompt": prompt})
        self.runtime.emit(MessageAdded(self, message))
        self._cancelled = self._cancelled and self._task is None
        self._task = asyncio.current_task()
        self._set_phase("splitting the task", "running")
        subtask = {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": SUBTASK_TITLE_CHARS},
                "task": {"type": "string", "maxLength": SUBTASK_CHARS},
            },
            "required": ["title", "task"],
            "additionalProperties": False,
        }
        split_schema = {
            "type": "object",
            "properties": {
                "subtasks": {
                    "type": "array",
                    "minItems": count,
                    "maxItems": count,
                    "items": subtask,
                }
            },
            "required": ["subtasks"],
            "additionalProperties": False,
        }
        try:
            split = await self._model_turn(
                ToolChoice("none"),
                tools_on=False,
                response_format=Grammar.json_schema(split_schema),
                # room for N subtasks at their longest (byte-level tokens included)
                max_tokens=count * (SUBTASK_TITLE_CHARS + SUBTASK_CHARS) * 4 + 64,
            )
            if split.finish == "error":
                self._set_phase("error", "error")
                return AgentResult("error", "", split.error)
            try:
                subtasks = json.loads(split.text)["subtasks"]
                subtasks = [{"title": str(t["title"]), "task": str(t["task"])} for t in subtasks]
            except (ValueError, KeyError, TypeError):
                self._set_phase("error", "error")
                error = "the model's split was cut short; raise /max and try again"
                return AgentResult("error", "", error)
            reply = self.record.messages[-1]
            review = self.runtime.approvals.review_split
            if review is not None:
                subtasks = await review(self.title, subtasks)
                if not subtasks:
                    text = "The split was not run (the user declined it)."
                    self.store.update_reply(reply, text, "done", {"stopped": True})
                    self.runtime.emit(MessageDone(self, reply))
                    self._set_phase("cancelled", "cancelled")
                    return AgentResult("cancelled", "", "the user declined the split")
                count = len(subtasks)
            calls = [
                ToolCall(
                    ToolCall.new_id(),
                    "task",
                    json.dumps(
                        {"description": t["title"], "prompt": t["task"], "agent_type": agent_type}
                    ),
                )
                for t in subtasks
            ]
            meta = {
                "tool_calls": [
                    {"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls
                ]
            }
            self.store.update_reply(reply, f"Splitting into {count} subagents.", "done", meta)
            self.runtime.emit(MessageDone(self, reply))
            await self._run_calls(calls, {"task": task_tool.FANOUT})
            result = await self._model_turn(ToolChoice("none"), tools_on=False)
            if result.finish == "error":
                self._set_phase("error", "error")
                return AgentResult("error", result.text, result.error)
            self._set_phase("done", "done")
            return AgentResult("done", result.text)
        except asyncio.CancelledError:
            return self._cancelled_result()
        except Exception as exc:
            return self._failed(exc)
