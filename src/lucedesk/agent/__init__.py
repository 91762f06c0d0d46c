"""Agents: a session runs the loop model turn → tool calls → results → model turn, with tools
confined to a workspace, approvals for writes and commands, MCP servers' tools, and the
`task` tool that runs child sessions in parallel engine slots. No Textual here: the TUI, the
headless `lucedesk agent` (through `run_to_answer`) and the tests all drive these same
classes.

    runtime = Runtime(EngineBackend(lambda: engine), store, Approvals(ask=...))
    record = store.create_session("fix the bug", agent_type="general", workspace="/src/app")
    result = await AgentSession(runtime, record).send("The tests fail on ... fix it.")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The table of agent kinds is light and loaded with the package (the CLI's parser reads it);
# the rest on first use, so that a command without agents does not import them.
from lucedesk.agent.agent_types import AGENT_TYPES, SWITCHES, TASK_TYPES, AgentType

if TYPE_CHECKING:
    from lucedesk.agent.approvals import ApprovalRequest, Approvals
    from lucedesk.agent.backend import Backend, EngineBackend, OpenAIBackend
    from lucedesk.agent.children import split_progress, split_text
    from lucedesk.agent.compaction import Policy
    from lucedesk.agent.compactor import marker_line
    from lucedesk.agent.events import (
        AgentEvent,
        ChildStarted,
        MessageAdded,
        MessageDone,
        Observer,
        PhaseChanged,
        ReasoningStreamed,
        TextStreamed,
    )
    from lucedesk.agent.run import Answer, run_to_answer
    from lucedesk.agent.runtime import AgentResult, Limits, Runtime
    from lucedesk.agent.session import AgentSession
    from lucedesk.agent.tools import BUILTIN, ToolContext, ToolError, ToolSpec, tools_for
    from lucedesk.agent.workspace import Workspace

_HOMES = {  # each name's module, loaded when the name is first asked for
    "ApprovalRequest": "approvals",
    "Approvals": "approvals",
    "Backend": "backend",
    "EngineBackend": "backend",
    "OpenAIBackend": "backend",
    "split_progress": "children",
    "split_text": "children",
    "Policy": "compaction",
    "marker_line": "compactor",
    "AgentEvent": "events",
    "ChildStarted": "events",
    "MessageAdded": "events",
    "MessageDone": "events",
    "Observer": "events",
    "PhaseChanged": "events",
    "ReasoningStreamed": "events",
    "TextStreamed": "events",
    "Answer": "run",
    "run_to_answer": "run",
    "AgentResult": "runtime",
    "Limits": "runtime",
    "Runtime": "runtime",
    "AgentSession": "session",
    "BUILTIN": "tools",
    "ToolContext": "tools",
    "ToolError": "tools",
    "ToolSpec": "tools",
    "tools_for": "tools",
    "Workspace": "workspace",
}

__all__ = [
    "AGENT_TYPES",
    "BUILTIN",
    "AgentEvent",
    "AgentResult",
    "AgentSession",
    "AgentType",
    "Answer",
    "ApprovalRequest",
    "Approvals",
    "Backend",
    "ChildStarted",
    "EngineBackend",
    "Limits",
    "MessageAdded",
    "MessageDone",
    "Observer",
    "OpenAIBackend",
    "Policy",
    "PhaseChanged",
    "Runtime",
    "ReasoningStreamed",
    "SWITCHES",
    "TASK_TYPES",
    "TextStreamed",
    "ToolContext",
    "ToolError",
    "ToolSpec",
    "Workspace",
    "marker_line",
    "split_progress",
    "split_text",
    "run_to_answer",
    "tools_for",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lucedesk.agent' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lucedesk.agent.{home}"), name)
