"""Child sessions: the `task` tool's subagents and `/fanout`. A child is an agent session like
any other, stored with its parent's id, started in its own asyncio task (so cancelling it
alone leaves the parent running) and reporting back one final message.

`/fanout N <task>` asks the model for N distinct subtasks held to a JSON schema, stores the
split as N `task` calls (the transcript reads like any other delegation), runs the children
at once, and ends with a turn that writes the synthesis from their results."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from lucedesk.agent.agent_types import AGENT_TYPES, TASK_TYPES, type_named
from lucedesk.agent.compactor import shorten_report
from lucedesk.agent.events import MessageAdded, MessageDone
from lucedesk.agent.runtime import AgentResult
from lucedesk.agent.tool_error import ToolError
from lucedesk.agent.tool_runner import run_calls
from lucedesk.agent.tools.task import FANOUT
from lucedesk.chat import ToolCall, ToolChoice, schema_grammar
from lucedesk.store import StoredMessage

if TYPE_CHECKING:
    from lucedesk.agent.live import LiveSession

CHILD_PROMPT = """\
You are a subagent: another agent gave you the task in the next message. Work on it with \
your tools, then answer with one final message. The other agent reads only that message, \
so put every finding it needs in it."""

SUBTASK_TITLE_CHARS = 60  # the longest title and task a /fanout split may write
SUBTASK_CHARS = 400

SPLIT_PROMPT = """\
Split this task into {count} distinct, self-contained subtasks that can be worked on at the \
same time by {count} subagents who see nothing but their own subtask. Task: {task}"""


def new_child(parent: LiveSession, description: str, type_name: str) -> LiveSession:
    """A stored child of `parent` of type `type_name`, not started; a ToolError when the type
    is unknown, the depth limit is reached or the parent's type may not start it."""
    s = parent.record
    if type_name not in AGENT_TYPES:
        raise ToolError("agent_type: " + " or ".join(TASK_TYPES))
    if parent.depth >= parent.runtime.limits.max_depth:
        raise ToolError("task: the depth limit is reached; do this work yourself")
    kind = type_named(s.agent_type)
    if type_name not in kind.may_start:
        allowed = " or ".join(t for t in TASK_TYPES if t in kind.may_start)
        raise ToolError(f"agent_type: an {kind.name} agent can only start {allowed} subagents")
    record = parent.store.create_session(
        description.strip()[:60] or "subtask",
        kind="subagent",
        parent_id=s.id,
        system_prompt=CHILD_PROMPT,
        temperature=s.temperature,
        max_tokens=s.max_tokens,
        agent_type=type_name,
        workspace=s.workspace,
        backend_url=s.backend_url,
    )
    return parent.adopt(record)


async def run_child(parent: LiveSession, description: str, prompt: str, type_name: str) -> str:
    """The `task` tool: a child runs `prompt` in its own task; its final message is the
    result, any other end a ToolError saying how it ended."""
    child = new_child(parent, description, type_name)
    if parent.cancelled:
        parent.store.set_status(child.record, "cancelled")
        raise asyncio.CancelledError
    running = asyncio.create_task(child.send(prompt))
    try:
        result = await running
    except asyncio.CancelledError:
        if child.record.status == "idle":  # cancelled before it began: it never ran
            parent.store.set_status(child.record, "cancelled")
        raise
    if result.status == "done":
        text = result.text.strip() or "(the subagent answered with an empty message)"
        return await shorten_report(child, prompt, text, parent.runtime.limits.compaction)
    if result.status == "cancelled":
        raise ToolError("the subagent was cancelled before it finished")
    if result.status == "step_limit":
        raise ToolError(f"the subagent stopped at its step limit. {result.text}")
    raise ToolError(f"the subagent failed: {result.error}")


def split_schema(count: int) -> dict:
    """The JSON schema of a split into exactly `count` subtasks."""
    subtask = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": SUBTASK_TITLE_CHARS},
            "task": {"type": "string", "maxLength": SUBTASK_CHARS},
        },
        "required": ["title", "task"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "subtasks": {"type": "array", "minItems": count, "maxItems": count, "items": subtask}
        },
        "required": ["subtasks"],
        "additionalProperties": False,
    }


async def fanout(
    session: LiveSession, count: int, task: str, type_name: str | None = None
) -> AgentResult:
    """`/fanout N <task>` on `session`: split, run the children at once, synthesize."""
    if type_name is None:  # children only look; a session without tools gives them none
        type_name = "chat" if session.tools() == [] else "explore"
    # Shown as the user wrote it; the model reads the split prompt (see chat_messages).
    prompt = SPLIT_PROMPT.format(count=count, task=task)
    line = f"/fanout {count} {task}"
    message = session.store.add_message(session.record, StoredMessage("user", line, prompt=prompt))
    session.runtime.emit(MessageAdded(session, message))
    return await session.guarded(lambda: _split_run_synthesize(session, count, type_name))


def split_text(subtasks: list[dict]) -> str:
    """A split as people read (and edit) it: each subtask a `## title` line, then its task."""
    return "\n\n".join(f"## {t['title']}\n{t['task']}" for t in subtasks)


def split_progress(message: StoredMessage) -> str | None:
    """What a split reply shows while its JSON streams in (None: not a split reply)."""
    count = message.split
    if not count:
        return None
    written = message.content.count('"task"')
    return f"Splitting the task into {count} subtasks… {min(written, count)} of {count} written"


async def _split_run_synthesize(session: LiveSession, count: int, type_name: str) -> AgentResult:
    session.set_phase("splitting the task", "running")
    split = await session.model_turn(
        ToolChoice("none"),
        tools_on=False,
        response_format=schema_grammar(split_schema(count)),
        # room for N subtasks at their longest (byte-level tokens included)
        max_tokens=count * (SUBTASK_TITLE_CHARS + SUBTASK_CHARS) * 4 + 64,
        split=count,  # its JSON streams in: shown as progress (split_progress)
    )
    if split.finish == "error":
        session.set_phase("error", "error")
        return AgentResult("error", "", split.error)
    try:
        subtasks = json.loads(split.text)["subtasks"]
        subtasks = [{"title": str(t["title"]), "task": str(t["task"])} for t in subtasks]
    except (ValueError, KeyError, TypeError):
        session.set_phase("error", "error")
        return AgentResult("error", "", "the model's split was cut short; raise /max and try again")
    reply = session.record.messages[-1]
    review = session.runtime.approvals.review_split
    if review is not None:
        subtasks = await review(session.title, subtasks)
        if not subtasks:
            text = "The split was not run (the user declined it)."
            reply.split, reply.stopped = 0, True
            session.store.update_reply(reply, text, "done")
            session.runtime.emit(MessageDone(session, reply))
            session.set_phase("cancelled", "cancelled")
            return AgentResult("cancelled", "", "the user declined the split")
        count = len(subtasks)
    calls = [
        ToolCall(
            ToolCall.new_id(),
            "task",
            json.dumps({"description": t["title"], "prompt": t["task"], "agent_type": type_name}),
        )
        for t in subtasks
    ]
    reply.split, reply.tool_calls = 0, calls
    shown = f"Split into {count} subtasks:\n\n{split_text(subtasks)}"
    session.store.update_reply(reply, shown, "done")
    session.runtime.emit(MessageDone(session, reply))
    await run_calls(session, calls, {"task": FANOUT})
    result = await session.model_turn(ToolChoice("none"), tools_on=False)
    if result.finish == "error":
        session.set_phase("error", "error")
        return AgentResult("error", result.text, result.error)
    session.set_phase("done", "done")
    return AgentResult("done", result.text)
