"""The built-in tools, one module each; MCP servers add theirs (lucedesk.agent.mcp)."""

from __future__ import annotations

from lucedesk.agent.tools import (
    edit_file,
    glob,
    grep,
    list_dir,
    read_file,
    run_command,
    task,
    write_file,
)
from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec

BUILTIN: tuple[ToolSpec, ...] = (
    read_file.TOOL,
    list_dir.TOOL,
    glob.TOOL,
    grep.TOOL,
    write_file.TOOL,
    edit_file.TOOL,
    run_command.TOOL,
)
TASK = task.TOOL
AGENT_TYPES = ("chat", "explore", "general")  # chat: no tools


def tools_for(agent_type: str, extra: list[ToolSpec], can_spawn: bool) -> list[ToolSpec]:
    """What an agent of `agent_type` may call: explore agents only look; general agents get
    every tool, MCP servers' tools and, below the depth limit, `task`."""
    if agent_type == "chat":
        return []
    if agent_type == "explore":
        return [t for t in BUILTIN if t.access == "read"]
    return [*BUILTIN, *extra, *([TASK] if can_spawn else [])]


__all__ = ["AGENT_TYPES", "BUILTIN", "TASK", "ToolContext", "ToolError", "ToolSpec", "tools_for"]
