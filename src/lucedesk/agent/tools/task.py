"""task: hand a subtask to a child agent with a fresh context and its own tools. Several
task calls in one turn run at the same time, each child in its own engine slot; each returns
the child's final message."""

from __future__ import annotations

from dataclasses import replace

from lucedesk.agent.agent_types import AGENT_TYPES, TASK_TYPES, TYPES
from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, schema


async def task(ctx: ToolContext, args: dict) -> str:
    if ctx.start_child is None:
        raise ToolError("task: subagents cannot be started here")
    return await ctx.start_child(
        args["description"], args["prompt"], args.get("agent_type", "explore")
    )


TOOL = ToolSpec(
    "task",
    "Start a subagent for a self-contained subtask. It starts with a fresh context (it sees "
    "only `prompt`, so put everything it needs there), works with its own tools and returns "
    "one final message. Call task several times in one turn to run subagents in parallel. "
    "Agent types: " + "; ".join(f"{k}: {TYPES[k].description}" for k in TASK_TYPES) + ".",
    schema(
        {
            "description": {"type": "string", "description": "a short title (3-6 words)"},
            "prompt": {"type": "string", "description": "the whole task for the subagent"},
            "agent_type": {"type": "string", "enum": list(TASK_TYPES)},
        },
        ["description", "prompt"],
    ),
    task,
    "task",
)


# /fanout's own calls: its children may also be plain chats (a session without tools).
FANOUT = replace(
    TOOL,
    parameters={
        **TOOL.parameters,
        "properties": {
            **TOOL.parameters["properties"],
            "agent_type": {
                "type": "string",
                "enum": [*TASK_TYPES, *(k for k in AGENT_TYPES if k not in TASK_TYPES)],
            },
        },
    },
)
