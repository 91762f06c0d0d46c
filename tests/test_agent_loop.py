"""The agent loop driven by a scripted model: each model turn's reply comes from a script,
but every turn also runs a real request in a real engine slot (a tiny random model), so
children run concurrently, cancel frees slots, and timing is real. The last test runs one
session against a real `lucedesk serve` on the default model."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from lucedesk.agent import (
    AgentSession,
    ApprovalRequest,
    Approvals,
    ChildStarted,
    Limits,
    OpenAIBackend,
    Runtime,
)
from lucedesk.chat import ToolCall, ToolChoice, TurnRequest, TurnResult
from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import SamplingParams
from lucedesk.store import Store
from tests.engine_harness import make_engine
from tests.test_agent_tools import gone_soon

CHILD_TOKENS = 200  # engine tokens per child turn: long enough for the children to overlap
READ_TOOLS = {"read_file", "list_dir", "glob", "grep"}


class Reply(NamedTuple):
    text: str = ""
    calls: tuple[ToolCall, ...] = ()
    tokens: int = 4  # what the turn's engine request generates (it holds a slot meanwhile)


Script = Callable[[TurnRequest], Reply]


@dataclass
class Span:
    """One turn's engine request: when its first token came and when it ended."""

    owner: str
    start: float | None = None
    end: float | None = None
    num_tokens: int = 0


@dataclass
class ScriptedBackend:
    """A Backend whose replies come from `script`, each turn also running a real engine
    request (greedy, ignore_eos, `reply.tokens` long) under the session's owner. The reply's
    text streams as the engine's tokens come; cancelling the turn cancels the request."""

    engine: object
    prompt_ids: list[int]
    script: Script
    label: str = "scripted"
    requests: list[tuple[str, TurnRequest]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)

    async def turn(self, req: TurnRequest, owner: str, on_text, on_reasoning) -> TurnResult:
        self.requests.append((owner, req))
        reply = self.script(req)
        params = SamplingParams(max_tokens=reply.tokens, temperature=0.0, ignore_eos=True)
        handle = self.engine.submit(self.prompt_ids, params, owner=owner)
        span = Span(owner)
        self.spans.append(span)
        pieces = reply.text.split(" ") if reply.text else []
        try:
            async for out in handle:
                span.start = span.start or time.monotonic()
                span.num_tokens += len(out.token_ids)
                if pieces and out.token_ids:
                    on_text(pieces.pop(0) + (" " if pieces else ""))
        finally:
            span.end = time.monotonic()
            if not handle.finished:
                handle.cancel()
        if pieces:
            on_text(" ".join(pieces))
        calls = list(reply.calls)
        finish = "tool_calls" if calls else "stop"
        return TurnResult(
            reply.text, calls, finish, len(self.prompt_ids), span.num_tokens, None, []
        )

    async def context_limit(self) -> int | None:
        return None  # scripted replies read no prompt: nothing to compact

    def count(self, texts) -> list[int]:
        return [len(t) // 4 for t in texts]

    def prompt_tokens(self, req: TurnRequest) -> int:
        return len(self.prompt_ids)

    def seen_by(self, session: AgentSession) -> list[TurnRequest]:
        """The requests of one session's turns, in order."""
        return [req for owner, req in self.requests if owner == session.owner]

    def spans_of(self, session: AgentSession) -> list[Span]:
        return [s for s in self.spans if s.owner == session.owner]


def first_user(req: TurnRequest) -> str:
    return next(m.content for m in req.messages if m.role == "user")


def results(req: TurnRequest) -> dict[str, str]:
    """The tool results the model sees, by call id."""
    return {m.tool_call_id: m.content for m in req.messages if m.role == "tool"}


def call(name: str, arguments: dict | str, call_id: str | None = None) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(call_id or ToolCall.new_id(), name, text)


def task(prompt: str, agent_type: str = "explore", call_id: str | None = None) -> ToolCall:
    args = {"description": prompt, "prompt": prompt, "agent_type": agent_type}
    return call("task", args, call_id)


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load_model(tiny_llama, torch.float32)


@pytest.fixture(scope="module")
def engine(loaded):
    engine = make_engine(loaded, kernels="torch", max_slots=4, kv_pool_tokens=4096).start()
    yield engine
    engine.shutdown()


@pytest.fixture
def ws(tmp_path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "notes.txt").write_text("The launch code is 7431.\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("the secret is 42\n")
    return root


@dataclass
class Harness:
    """A store, a scripted backend and a runtime around them; `children` as they start."""

    store: Store
    backend: ScriptedBackend
    runtime: Runtime
    workspace: Path
    children: list[AgentSession] = field(default_factory=list)

    def session(self, title: str = "parent", agent_type: str = "general", **kw) -> AgentSession:
        record = self.store.create_session(
            title,
            agent_type=agent_type,
            workspace=str(self.workspace),
            temperature=0.0,
            max_tokens=64,
        )
        return AgentSession(self.runtime, record, **kw)

    def observe(self, event) -> None:
        if isinstance(event, ChildStarted):
            self.children.append(event.child)


@pytest.fixture
def make(engine, loaded, tmp_path, ws):
    """make(script, limits=..., approvals=...) -> Harness"""
    stores = []

    def build(script: Script, limits: Limits | None = None, approvals: Approvals | None = None):
        store = Store(tmp_path / "sessions.db")
        stores.append(store)
        prompt_ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
        backend = ScriptedBackend(engine, prompt_ids, script)
        runtime = Runtime(backend, store, approvals or Approvals(), limits=limits or Limits())
        harness = Harness(store, backend, runtime, ws)
        runtime.observer = harness.observe
        return harness

    yield build
    for store in stores:
        store.close()


def started(h: Harness, session: AgentSession) -> bool:
    """Whether the session's first turn has a token from its engine slot."""
    spans = h.backend.spans_of(session)
    return bool(spans) and spans[0].start is not None


def fan_out_script(final: str = "all done") -> Script:
    """The parent asks for three explore children in one turn, then answers with their
    results; child i answers "found part i" after a long engine turn."""

    def script(req: TurnRequest) -> Reply:
        user = first_user(req)
        if user.startswith("find part"):
            return Reply(f"found {user.removeprefix('find ')}", tokens=CHILD_TOKENS)
        if not results(req):
            return Reply(calls=tuple(task(f"find part {i}", call_id=f"t{i}") for i in range(3)))
        return Reply(f"{final}: " + " | ".join(results(req)[f"t{i}"] for i in range(3)))

    return script


# -- children -------------------------------------------------------------------------------


async def test_three_task_calls_run_three_children_at_once(make):
    h = make(fan_out_script())
    parent = h.session()
    result = await parent.send("split the work")
    assert result == ("done", "all done: found part 0 | found part 1 | found part 2", None)

    assert len(h.children) == 3
    spans = [h.backend.spans_of(child)[0] for child in h.children]
    assert all(s.num_tokens == CHILD_TOKENS for s in spans)
    assert max(s.start for s in spans) < min(s.end for s in spans)  # all in slots at once

    last = h.backend.seen_by(parent)[-1]
    assert results(last) == {f"t{i}": f"found part {i}" for i in range(3)}

    stored = {s.id: s for s in h.store.sessions("subagent")}
    assert set(stored) == {child.id for child in h.children}
    for i, child in enumerate(h.children):
        s = stored[child.id]
        assert (s.kind, s.parent_id, s.status, s.agent_type) == (
            "subagent",
            parent.id,
            "done",
            "explore",
        )
        assert [(m.role, m.content) for m in s.messages] == [
            ("user", f"find part {i}"),
            ("assistant", f"found part {i}"),
        ]


async def test_cancelling_one_child_leaves_the_others_running(make):
    h = make(fan_out_script())
    parent = h.session()
    run = asyncio.create_task(parent.send("split the work"))
    await until(lambda: len(h.children) == 3 and started(h, h.children[1]))
    victim = h.children[1]
    victim.cancel()
    result = await run

    assert result.status == "done"
    assert "error: the subagent was cancelled" in result.text
    last = results(h.backend.seen_by(parent)[-1])
    assert last["t0"] == "found part 0" and last["t2"] == "found part 2"
    assert last["t1"].startswith("error: the subagent was cancelled")
    assert h.backend.spans_of(victim)[0].num_tokens < CHILD_TOKENS
    for i in (0, 2):
        assert h.backend.spans_of(h.children[i])[0].num_tokens == CHILD_TOKENS
    statuses = [h.store.session(c.id).status for c in h.children]
    assert statuses == ["done", "cancelled", "done"]


async def test_cancelling_the_parent_cancels_its_children(make, engine):
    h = make(fan_out_script())
    parent = h.session()
    run = asyncio.create_task(parent.send("split the work"))
    await until(lambda: len(h.children) == 3 and all(started(h, c) for c in h.children))
    parent.cancel()
    result = await run

    assert result.status == "cancelled"
    assert all(h.backend.spans_of(c)[0].num_tokens < CHILD_TOKENS for c in h.children)
    reloaded = [h.store.session(s.id) for s in [parent, *h.children]]
    assert [s.status for s in reloaded] == ["cancelled"] * 4
    assert all(m.status == "done" for s in reloaded for m in s.messages)
    await until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0, 5)


async def test_children_at_the_depth_limit_get_no_task_tool(make):
    def script(req: TurnRequest) -> Reply:
        user = first_user(req)
        if user == "go deeper":  # the child tries to start a grandchild anyway
            if not results(req):
                return Reply(calls=(task("grandchild work", call_id="g"),))
            return Reply("child: " + results(req)["g"])
        if not results(req):
            return Reply(calls=(task("go deeper", "general", call_id="c"),))
        return Reply("parent: " + results(req)["c"])

    h = make(script, limits=Limits(max_depth=1))
    parent = h.session()
    result = await parent.send("start")
    assert result.status == "done"
    [child] = h.children
    assert "task" in {t.name for t in h.backend.seen_by(parent)[0].tools}
    child_tools = {t.name for t in h.backend.seen_by(child)[0].tools}
    assert "task" not in child_tools and {"write_file", "run_command"} <= child_tools
    refusal = results(h.backend.seen_by(child)[1])["g"]
    assert refusal == "error: task: the depth limit is reached; do this work yourself"
    assert [s.id for s in h.store.sessions("subagent")] == [child.id]  # no grandchild


async def test_explore_children_get_only_read_tools(make):
    def script(req: TurnRequest) -> Reply:
        user = first_user(req)
        if user == "look around":
            if not results(req):  # an explore child that tries to write anyway
                return Reply(calls=(call("write_file", {"path": "x", "content": "x"}, "w"),))
            return Reply("explored: " + results(req)["w"])
        if user == "do work":
            return Reply("worked")
        if not results(req):
            return Reply(calls=(task("look around", "explore", "e"), task("do work", "general")))
        return Reply("done")

    h = make(script)
    parent = h.session()
    assert (await parent.send("start")).status == "done"
    explore, general = sorted(h.children, key=lambda c: c.record.agent_type != "explore")
    assert {t.name for t in h.backend.seen_by(explore)[0].tools} == READ_TOOLS
    general_tools = {t.name for t in h.backend.seen_by(general)[0].tools}
    assert general_tools == READ_TOOLS | {"write_file", "edit_file", "run_command", "task"}
    assert results(h.backend.seen_by(explore)[1])["w"].startswith(
        "error: unknown tool 'write_file'"
    )
    assert not (h.workspace / "x").exists()


async def test_fanout_splits_runs_children_and_synthesizes(make):
    def script(req: TurnRequest) -> Reply:
        if req.response_format is not None:
            subtasks = [{"title": f"part {i}", "task": f"find part {i}"} for i in range(3)]
            return Reply(json.dumps({"subtasks": subtasks}))
        user = first_user(req)
        if user.startswith("find part"):
            return Reply(f"found {user.removeprefix('find ')}", tokens=CHILD_TOKENS)
        return Reply("synthesis of three parts")

    h = make(script)
    parent = h.session()
    result = await parent.fanout(3, "survey the code")
    assert result == ("done", "synthesis of three parts", None)

    split, synthesis = h.backend.seen_by(parent)
    schema = json.loads(split.response_format.source)
    assert schema["properties"]["subtasks"]["minItems"] == 3
    assert "survey the code" in first_user(split) and split.tools == []
    assert sorted(results(synthesis).values()) == [f"found part {i}" for i in range(3)]
    assert synthesis.response_format is None

    assert [c.title for c in h.children] == ["part 0", "part 1", "part 2"]
    assert all(c.record.agent_type == "explore" for c in h.children)
    spans = [h.backend.spans_of(c)[0] for c in h.children]
    assert max(s.start for s in spans) < min(s.end for s in spans)
    stored = h.store.session(parent.id)
    calls = stored.messages[1].meta()["tool_calls"]
    assert [json.loads(c["arguments"])["prompt"] for c in calls] == [
        f"find part {i}" for i in range(3)
    ]
    assert stored.status == "done" and stored.messages[-1].content == "synthesis of three parts"


# -- the loop's limits and errors -----------------------------------------------------------


async def test_step_limit_stops_a_model_that_always_calls_a_tool(make):
    h = make(lambda req: Reply(calls=(call("list_dir", {}),)), limits=Limits(max_steps=3))
    session = h.session()
    result = await session.send("loop forever")
    assert result.status == "step_limit"
    assert "step limit of 3 model turns" in result.text
    assert len(h.backend.requests) == 3
    stored = h.store.session(session.id)
    assert stored.status == "step_limit"
    assert stored.messages[-1].role == "assistant"
    assert stored.messages[-1].content == result.text


async def test_bad_calls_get_clear_errors_and_the_session_goes_on(make):
    bad = (
        call("no_such_tool", {}, "unknown"),
        call("read_file", '{"path": "notes.txt"', "not_json"),
        call("read_file", {}, "no_path"),
        call("read_file", {"path": "notes.txt", "offset": "x"}, "bad_offset"),
        call("read_file", {"path": "notes.txt", "color": "red"}, "extra"),
    )

    def script(req: TurnRequest) -> Reply:
        return Reply("recovered") if results(req) else Reply(calls=bad)

    h = make(script)
    session = h.session()
    assert await session.send("try things") == ("done", "recovered", None)
    seen = results(h.backend.seen_by(session)[1])
    assert seen["unknown"].startswith(
        "error: unknown tool 'no_such_tool'; the tools are: read_file"
    )
    assert seen["not_json"].startswith("error: arguments: not valid JSON")
    assert seen["no_path"] == (
        "error: arguments: 'path' is a required property (the arguments of read_file)"
    )
    assert seen["bad_offset"] == (
        "error: offset: 'x' is not of type 'integer' (the arguments of read_file)"
    )
    assert seen["extra"].startswith("error: arguments: Additional properties are not allowed")
    tools = [m for m in h.store.session(session.id).messages if m.role == "tool"]
    assert all(m.meta()["error"] is True and m.status == "done" for m in tools)


async def test_a_path_outside_the_workspace_is_refused_through_the_loop(make):
    def script(req: TurnRequest) -> Reply:
        if results(req):
            return Reply("gave up")
        return Reply(calls=(call("read_file", {"path": "../outside/secret.txt"}, "r"),))

    h = make(script)
    session = h.session()
    assert (await session.send("read the secret")).status == "done"
    seen = results(h.backend.seen_by(session)[1])["r"]
    assert seen.startswith("error: path: ../outside/secret.txt is outside the workspace")
    assert "the secret is" not in seen  # its contents, not read


async def test_a_declined_write_leaves_the_file_and_the_model_hears_it(make):
    asked: list[ApprovalRequest] = []

    async def say_no(request: ApprovalRequest) -> bool:
        asked.append(request)
        return False

    def script(req: TurnRequest) -> Reply:
        if results(req):
            return Reply("ok, left it")
        return Reply(calls=(call("write_file", {"path": "notes.txt", "content": "gone\n"}, "w"),))

    h = make(script, approvals=Approvals(ask=say_no))
    session = h.session()
    assert (await session.send("overwrite notes")).status == "done"
    assert (h.workspace / "notes.txt").read_text() == "The launch code is 7431.\n"
    assert results(h.backend.seen_by(session)[1])["w"] == (
        "error: the user declined to edit notes.txt"
    )
    [request] = asked
    assert request.session_title == "parent" and "-The launch code is 7431." in request.detail


# -- persistence ----------------------------------------------------------------------------


async def test_everything_is_persisted_as_it_happens(make, tmp_path):
    def script(req: TurnRequest) -> Reply:
        if results(req):
            return Reply("notes.txt holds the launch code")
        return Reply("Looking.", calls=(call("list_dir", {}, "ls"),))

    h = make(script)
    session = h.session()
    await session.send("what is here?")
    reopened = Store(tmp_path / "sessions.db")
    try:
        stored = reopened.session(session.id)
    finally:
        reopened.close()
    assert stored.status == "done"
    user, asked, tool, final = stored.messages
    assert (user.role, user.content) == ("user", "what is here?")
    assert (asked.role, asked.content) == ("assistant", "Looking.")
    assert asked.meta()["tool_calls"] == [{"id": "ls", "name": "list_dir", "arguments": "{}"}]
    assert tool.role == "tool" and "notes.txt" in tool.content
    assert tool.meta() == {
        "tool_call_id": "ls",
        "name": "list_dir",
        "arguments": "{}",
        "error": False,
    }
    assert (final.role, final.content) == ("assistant", "notes.txt holds the launch code")
    assert all(m.status == "done" for m in stored.messages)


async def test_a_crash_mid_tool_leaves_it_interrupted(make, tmp_path):
    command = "echo $$ > sleeper.pid; sleep 30"

    def script(req: TurnRequest) -> Reply:
        if results(req):
            return Reply("slept")
        return Reply(calls=(call("run_command", {"command": command}, "cmd"),))

    h = make(script, approvals=Approvals(allow_commands=True))
    session = h.session()
    run = asyncio.create_task(session.send("sleep a while"))
    pid_file = h.workspace / "sleeper.pid"
    await until(lambda: pid_file.exists() and pid_file.read_text().strip() != "")

    # What another process sees while it runs: a tool call in flight, a running session.
    raw = sqlite3.connect(f"file:{tmp_path / 'sessions.db'}?mode=ro", uri=True)
    try:
        tool_status = raw.execute(
            "SELECT status FROM messages WHERE session_id = ? AND role = 'tool'", (session.id,)
        ).fetchall()
        session_status = raw.execute(
            "SELECT status FROM sessions WHERE id = ?", (session.id,)
        ).fetchone()
    finally:
        raw.close()
    assert tool_status == [("streaming",)] and session_status == ("running",)

    # Opened beside the live process, the store leaves its work running...
    beside = Store(tmp_path / "sessions.db")
    try:
        assert beside.session(session.id).status == "running"
        # ...and interrupts it once that process is gone (the OS drops its lock).
        h.store.owner.release()
        beside.interrupt_orphans()
        stored = beside.session(session.id)
    finally:
        beside.close()
    assert stored.status == "interrupted"
    assert [m.status for m in stored.messages] == ["done", "done", "interrupted"]

    session.cancel()
    assert (await run).status == "cancelled"
    assert gone_soon(int(pid_file.read_text()))


# -- a real server ----------------------------------------------------------------------------


class RecordingOpenAIBackend(OpenAIBackend):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.requests: list[TurnRequest] = []

    async def turn(self, req: TurnRequest, owner: str, on_text, on_reasoning) -> TurnResult:
        self.requests.append(req)
        return await super().turn(req, owner, on_text, on_reasoning)


@pytest.mark.default_model
async def test_openai_backend_runs_a_tool_loop_against_lucedesk_serve(serve, tmp_path, ws):
    """The call, its result and the final answer go over the wire. (The 135M model names
    the path "list_dir", so the result may be an error: the loop is what is tested.)"""
    store = Store(tmp_path / "remote.db")
    backend = RecordingOpenAIBackend(serve)
    try:
        runtime = Runtime(backend, store)
        record = store.create_session(
            "remote", agent_type="general", workspace=str(ws), temperature=0.0, max_tokens=128
        )
        choices = [ToolChoice("function", "list_dir"), ToolChoice("none")]
        session = AgentSession(runtime, record, tool_choices=choices)
        result = await session.send("Call list_dir with path '.', then name the files it lists.")
        stored = store.session(record.id)
    finally:
        store.close()
    assert result.status == "done" and result.text.strip()
    assert stored.status == "done"
    user, asked, tool, final = stored.messages
    [made] = asked.meta()["tool_calls"]
    assert made["name"] == "list_dir" and isinstance(json.loads(made["arguments"]), dict)
    assert tool.status == "done" and tool.content
    assert tool.meta()["tool_call_id"] == made["id"] and tool.meta()["name"] == "list_dir"
    assert final.content == result.text and "tool_calls" not in final.meta()
    first, second = backend.requests
    assert first.tool_choice == ToolChoice("function", "list_dir")
    assert second.tool_choice == ToolChoice("none")
    assert results(second) == {made["id"]: tool.content}


# -- cancels at the edges: before a run starts, before a child begins ---------------------


async def test_a_child_cancelled_as_it_appears_never_runs(make):
    h = make(fan_out_script())

    def observe(event) -> None:
        h.observe(event)
        if isinstance(event, ChildStarted) and len(h.children) == 2:
            event.child.cancel()  # as the TUI may, the moment the child shows in the list

    h.runtime.observer = observe
    parent = h.session()
    result = await parent.send("split the work")
    assert result.status == "done"
    victim = h.children[1]
    assert results(h.backend.seen_by(parent)[-1])["t1"].startswith(
        "error: the subagent was cancelled"
    )
    assert h.backend.spans_of(victim) == [] and h.store.session(victim.id).status == "cancelled"


async def test_a_parent_cancelled_as_its_children_appear_leaves_none_idle(make):
    h = make(fan_out_script())
    parent = h.session()

    def observe(event) -> None:
        h.observe(event)
        if isinstance(event, ChildStarted) and len(h.children) == 3:
            asyncio.get_running_loop().call_soon(parent.cancel)

    h.runtime.observer = observe
    assert (await parent.send("split the work")).status == "cancelled"
    assert [h.store.session(c.id).status for c in h.children] == ["cancelled"] * 3


async def test_a_session_whose_workspace_is_gone_ends_in_error_not_a_crash(make, tmp_path):
    h = make(lambda req: Reply("never"))
    record = h.store.create_session("gone", agent_type="general", workspace=str(tmp_path / "no"))
    result = await AgentSession(h.runtime, record).send("hello")
    assert result.status == "error" and "not a folder" in result.error
    assert h.store.session(record.id).status == "error"
