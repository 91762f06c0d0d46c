"""The kinds of agent, in one table: what each may call, the system prompt it starts from,
the words the `task` tool and the help texts use for it, and which subagents it may start.
The tools, the `task` tool's schema, the sessions, the CLI and the TUI all read it."""

from __future__ import annotations

from dataclasses import dataclass

AGENT_PROMPT = """\
You are an agent working in a workspace folder. Use the tools to look at files, search and \
(when asked) change them, one step at a time; tool paths are relative to the workspace \
('.' is its root). When you have what you need, answer in plain text."""


@dataclass(slots=True, frozen=True)
class AgentType:
    name: str
    summary: str  # a few words for help texts
    # What the `task` tool's description tells the model of it; "" when `task` cannot start
    # it (a chat child comes only from /fanout).
    description: str
    switch: str  # its word in `--tools` and `/tools`: on, read, off
    access: frozenset[str]  # the built-in tools it gets, by their access (tools.base.Access)
    mcp_tools: bool  # MCP servers' tools too
    delegates: bool  # the `task` tool, below the depth limit
    prompt: str  # put before the session's own system prompt ("" : nothing)
    may_start: tuple[str, ...]  # the types of the subagents it may start


CHAT = AgentType(
    "chat",
    "no tools",
    "",
    "off",
    frozenset(),
    mcp_tools=False,
    delegates=False,
    prompt="",
    may_start=("chat", "explore", "general"),
)
EXPLORE = AgentType(
    "explore",
    "read-only tools",
    "read-only tools (read_file, list_dir, glob, grep): for looking things up",
    "read",
    frozenset({"read"}),
    mcp_tools=False,
    delegates=False,
    prompt=AGENT_PROMPT,
    may_start=("chat", "explore"),
)
GENERAL = AgentType(
    "general",
    "every tool",
    "every tool this agent has: for work that changes files or runs commands",
    "on",
    frozenset({"read", "write", "exec"}),
    mcp_tools=True,
    delegates=True,
    prompt=AGENT_PROMPT,
    may_start=("chat", "explore", "general"),
)

TYPES: dict[str, AgentType] = {t.name: t for t in (CHAT, EXPLORE, GENERAL)}
AGENT_TYPES = tuple(TYPES)
# What the `task` tool may start (its schema's enum, in this order) and `lucedesk agent --agent`
# runs: the types with tools.
TASK_TYPES = tuple(t.name for t in TYPES.values() if t.description)
# `--tools` / `/tools` word -> agent type name.
SWITCHES = {t.switch: t.name for t in TYPES.values()}


def type_named(name: str) -> AgentType:
    """The type called `name`; a name this table lacks (written by another version into the
    store) is taken as general, the type with every tool."""
    return TYPES.get(name, GENERAL)
