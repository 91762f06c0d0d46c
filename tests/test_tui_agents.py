"""Agents in the TUI, driven by Textual's pilot: a scripted model on the app's own engine
starts children; they show in the sidebar under their parent while they run, one opens with
its tool calls, Esc on it cancels it alone. And a `kill -9` of the TUI process mid-reply."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lucedesk.agent import Limits, Runtime
from lucedesk.store import Store
from lucedesk.tui.messages import SessionChosen
from lucedesk.tui.widgets.chat_input import ChatInput
from lucedesk.tui.widgets.engine_status import EngineStatus
from lucedesk.tui.widgets.session_list import SessionList
from lucedesk.tui.widgets.tool_call_view import ToolCallView
from tests.test_agent_loop import Reply, ScriptedBackend, call, first_user, task
from tests.test_tui import SIZE, make_app, prepare, started, type_and_send, wait_for


@pytest.fixture
def env(tmp_path, monkeypatch, tiny_llama):
    return prepare(tmp_path, monkeypatch, tiny_llama)


def script(req):
    """The parent starts two children; each lists the workspace, then writes a long
    answer; the parent then answers from their results."""
    asked = first_user(req)
    if asked == "look around":
        if not any(m.role == "tool" for m in req.messages):
            return Reply(calls=(task("child A"), task("child B")))
        return Reply("both children reported back", tokens=2)
    if not any(m.role == "tool" for m in req.messages):
        return Reply(calls=(call("list_dir", {"path": "."}),))
    return Reply(f"{asked} is done", tokens=150)


async def test_children_show_under_their_parent_and_esc_cancels_one(env):
    app = make_app(env, slots=4, tools="general")
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        engine = app.host.engine
        prompt = engine.tokenizer.encode("hello there")
        backend = ScriptedBackend(engine, prompt, script)
        agents = app.agents
        agents.runtimes[""] = Runtime(
            backend, app.store, agents.approvals, [], agents.observe, Limits()
        )
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "look around")
        tree = screen.query_one(SessionList)

        def children():
            node = tree.node_of(pane.session.id)
            return [n.data for n in node.children] if node is not None else []

        await wait_for(pilot, lambda: len(children()) == 2)
        status = screen.query_one(EngineStatus)
        await wait_for(pilot, lambda: " 0 running" not in status.shown)
        a, b = (agents.live[i] for i in children())
        assert "●" in str(tree.node_of(a.id).label)  # running, with its phase
        # Opening child A: the parent's pane is busy, so it opens beside it.
        await wait_for(pilot, lambda: any(m.role == "tool" for m in a.record.messages))
        screen.post_message(SessionChosen(a.id))
        await wait_for(pilot, lambda: len(screen.panes) == 2)
        child_pane = screen.panes[1]
        assert child_pane.session.id == a.id
        await wait_for(pilot, lambda: bool(child_pane.query(ToolCallView)))
        assert "list_dir" in str(child_pane.query_one(ToolCallView).title)
        # Esc there cancels child A only.
        child_pane.query_one(ChatInput).focus()
        await pilot.press("escape")
        await wait_for(pilot, lambda: not a.running)
        assert a.record.status == "cancelled"
        await wait_for(pilot, lambda: not pane.busy, 60)
        assert b.record.status == "done"
        results = [m for m in pane.session.messages if m.role == "tool"]
        assert results[0].content.startswith("error: the subagent was cancelled")
        assert results[1].content == "child B is done"
        assert pane.session.messages[-1].content == "both children reported back"


async def test_an_edit_waits_for_approval_in_a_dialog(env):
    app = make_app(env, slots=2, tools="general")
    workspace = env[0] / "workspace"

    def edits(req):
        if not any(m.role == "tool" for m in req.messages):
            return Reply(calls=(call("write_file", {"path": "new.txt", "content": "hi\n"}),))
        return Reply("written")

    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        backend = ScriptedBackend(app.host.engine, [1, 2, 3], edits)
        agents = app.agents
        agents.runtimes[""] = Runtime(backend, app.store, agents.approvals, [], agents.observe)
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "write it")
        from lucedesk.tui.screens.approval import ApprovalDialog

        await wait_for(pilot, lambda: isinstance(app.screen, ApprovalDialog))
        assert "+hi" in app.screen.request.detail and not (workspace / "new.txt").exists()
        await wait_for(pilot, lambda: pane.header_text().startswith("● waiting for approval"))
        await pilot.press("y")
        await wait_for(pilot, lambda: not pane.busy)
        assert (workspace / "new.txt").read_text() == "hi\n"
        assert pane.session.messages[-1].content == "written"


class ThinkingBackend:
    """A model that reasons before it answers, in two streamed pieces."""

    label = "thinking"

    async def context_limit(self):
        return None  # no prompt is read: nothing to compact

    def count(self, texts):
        return [len(t) // 4 for t in texts]

    def prompt_tokens(self, req):
        return 0

    async def turn(self, req, owner, on_text, on_reasoning):
        import asyncio

        from lucedesk.chat import TurnResult

        on_reasoning("Weighing it ")
        await asyncio.sleep(0.2)
        on_reasoning("carefully.")
        on_text("Paris.")
        return TurnResult("Paris.", [], "stop", 3, 3, None, [], reasoning="Weighing it carefully.")


async def test_a_replys_reasoning_is_folded_under_it(env):
    from textual.widgets import Collapsible, Static

    from lucedesk.tui.widgets.message_view import MessageView

    app = make_app(env, slots=2, tools="off")
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        agents = app.agents
        agents.runtimes[""] = Runtime(
            ThinkingBackend(), app.store, agents.approvals, [], agents.observe
        )
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "Capital of France?")
        await wait_for(pilot, lambda: not pane.busy)

        def folded() -> Collapsible:
            reply = [v for v in pane.query(MessageView) if v.role == "assistant"][-1]
            assert reply.content == "Paris."
            return reply.query_one(Collapsible)

        await wait_for(pilot, lambda: bool(pane.query(Collapsible)))
        block = folded()
        assert block.collapsed and block.title == "thinking"

        def shown() -> str:
            return str(folded().query_one(".reasoning", Static).render())

        folded().collapsed = False  # opened: the whole reasoning
        await wait_for(pilot, lambda: shown() == "Weighing it carefully.")
        stored = pane.session.messages[-1]
        assert stored.meta()["reasoning"] == "Weighing it carefully."
        await pane.show_session(app.store.session(pane.session.id))  # as after a restart
        await wait_for(pilot, lambda: bool(pane.query(Collapsible)))
        assert folded().collapsed
        assert shown() == "Weighing it carefully."


CRASHING_TUI = """
import asyncio, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.test_tui import make_app, started, type_and_send, wait_for, SIZE
from lucedesk.agent import AgentSession

turn_request = AgentSession.turn_request
def long_reply(self, *args):
    req = turn_request(self, *args)
    req.sampling.ignore_eos, req.sampling.max_tokens = True, 100000
    return req
AgentSession.turn_request = long_reply
from lucedesk.engine.runner import TorchSeqEngine
execute = TorchSeqEngine.execute
def slowed(self, plan):  # the tiny model needs ~1 ms a step: a reply long enough to crash in
    time.sleep(0.02)
    return execute(self, plan)
TorchSeqEngine.execute = slowed

async def main():
    app = make_app((Path({tmp!r}), Path({model!r})), slots=2, extra=("max_model_len=4096",))
    async with app.run_test(size=(140, 44)) as pilot:
        screen = await started(pilot)
        pane = screen.panes[0]
        await type_and_send(pilot, pane, "first question")
        # saved from its first token, then at most once a second as it grows
        await wait_for(pilot, lambda: len(pane.session.messages) == 2)
        await pilot.pause(2.5)
        print("WRITTEN", flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


def test_kill_9_of_the_tui_mid_reply_loses_no_written_message(env, tmp_path):
    tmp, model = env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = textwrap.dedent(CRASHING_TUI).format(root=root, tmp=str(tmp), model=str(model))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "WRITTEN" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            line = proc.stdout.readline()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # A separate reader (the way the next start opens it) sees everything written.
    store = Store(tmp / "sessions.db")
    [session] = store.sessions()
    user, reply = session.messages
    assert user.content == "first question" and user.status == "done"
    assert reply.status == "interrupted" and reply.content
    assert session.status == "interrupted"
    store.close()
    json.dumps(reply.to_json())  # plain data, as saved
