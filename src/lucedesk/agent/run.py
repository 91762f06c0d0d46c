"""One agent session run to its final answer, for a caller without a TUI (`lucedesk agent -p`,
scripts): the session is created in the store, so it can be opened in the TUI afterwards, and
a cancel of the caller (Ctrl-C) stops the session and its children before the answer comes
back as cancelled."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from lucedesk.agent.approvals import Approvals
from lucedesk.agent.backend import Backend
from lucedesk.agent.events import Observer
from lucedesk.agent.runtime import Limits, Runtime
from lucedesk.agent.session import AgentSession
from lucedesk.agent.tools.base import ToolSpec
from lucedesk.agent.workspace import Workspace
from lucedesk.chat import ToolChoice
from lucedesk.store import Session, Store


class Answer(NamedTuple):
    status: str  # done | step_limit | cancelled | error (see AgentResult)
    text: str  # the final message
    error: str | None
    session: Session  # the stored session; its children have it as their parent


async def run_to_answer(
    backend: Backend,
    store: Store,
    workspace: Workspace,
    prompt: str,
    *,
    approvals: Approvals,
    limits: Limits,
    agent_type: str = "general",
    system: str = "",
    temperature: float = 0.0,
    max_tokens: int = 1024,
    tool_choices: list[ToolChoice] | None = None,
    extra_tools: list[ToolSpec] | None = None,
    on_event: Observer | None = None,
) -> Answer:
    """Runs `prompt` as a new session of `agent_type` in `workspace` until its final answer.
    `tool_choices` are those of successive model turns (the last holds for the rest);
    `extra_tools` are MCP servers' tools; `on_event` hears of every step as it happens."""
    runtime = Runtime(
        backend,
        store,
        approvals,
        extra_tools=extra_tools or [],
        observer=on_event,
        limits=limits,
    )
    record = store.create_session(
        prompt.strip().splitlines()[0][:60] or "agent",
        system_prompt=system,
        temperature=temperature,
        max_tokens=max_tokens,
        agent_type=agent_type,
        workspace=str(workspace.root),
        backend_url=getattr(backend, "url", ""),
    )
    session = AgentSession(runtime, record, tool_choices=tool_choices)
    task = asyncio.ensure_future(session.send(prompt))
    try:
        result = await asyncio.shield(task)
    except asyncio.CancelledError:  # the caller's cancel: the session and its children stop
        session.cancel()
        result = await task
    return Answer(result.status, result.text, result.error, record)
