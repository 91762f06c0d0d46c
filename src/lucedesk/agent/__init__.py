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

from lucedesk.agent.agent_types import AGENT_TYPES, SWITCHES, TASK_TYPES, AgentType
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
