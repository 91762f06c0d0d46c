"""The built-in tools, one module each; MCP servers add theirs (lucedesk.agent.mcp)."""

from __future__ import annotations

from lucedesk.agent.agent_types import type_named
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


def tools_for(type_name: str, extra: list[ToolSpec], can_spawn: bool) -> list[ToolSpec]:
    """What an agent of type `type_name` may call (see agent_types): chat agents nothing,
    explore agents the tools that only look; general agents every tool, MCP servers' tools
    (`extra`) and, below the depth limit (`can_spawn`), `task`."""
    kind = type_named(type_name)
    return [
        *(t for t in BUILTIN if t.access in kind.access),
        *(extra if kind.mcp_tools else []),
        *([TASK] if kind.delegates and can_spawn else []),
    ]


__all__ = ["BUILTIN", "TASK", "ToolContext", "ToolError", "ToolSpec", "tools_for"]
