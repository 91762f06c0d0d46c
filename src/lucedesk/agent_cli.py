"""`lucedesk agent -p "<task>"`: one agent session, run to its final answer without the TUI,
for scripts and CI. Progress (tool calls, children) goes to stderr, the answer to stdout, or
with --json the whole transcript, children included. The session is saved in the same store
as the TUI's, so it can be opened there afterwards."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from lucedesk.agent import (
    AgentEvent,
    ApprovalRequest,
    Approvals,
    Backend,
    ChildStarted,
    EngineBackend,
    MessageAdded,
    MessageDone,
    OpenAIBackend,
    Workspace,
    marker_line,
    run_to_answer,
)
from lucedesk.chat import ToolChoice
from lucedesk.commands import build_from_args
from lucedesk.commands.settings import agent_limits
from lucedesk.errors import ConfigError
from lucedesk.store import Session, Store, data_dir

if TYPE_CHECKING:
    from lucedesk.agent.mcp import McpHub


def parse_tool_choices(text: str) -> list[ToolChoice]:
    """`--tool-choice auto` or a list for successive model turns, the last one holding for
    the rest: `list_dir,read_file,auto` makes the first turn call list_dir, the second
    read_file (small models rarely call tools of their own accord)."""
    choices = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ConfigError(f"--tool-choice {text!r}: an empty entry")
        if item in ("auto", "required", "none"):
            choices.append(ToolChoice(item))
        elif item.replace("_", "").replace("-", "").isalnum():
            choices.append(ToolChoice("function", item))
        else:
            raise ConfigError(
                f"--tool-choice {text!r}: {item!r} is not auto, required, none or a tool"
            )
    return choices


class TerminalAsk:
    """Asks on the terminal (stdin a tty), one question at a time: parallel children wait
    their turn, so an answer always belongs to the request shown. The line is read on a
    daemon thread, so Ctrl-C at the question does not leave the process waiting for it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def __call__(self, request: ApprovalRequest) -> bool:
        async with self._lock:
            print(
                f"\n{request.session_title}: {request.summary}\n{request.detail}", file=sys.stderr
            )
            sys.stderr.write("allow? [y/N] ")  # stdout holds the answer, maybe redirected
            sys.stderr.flush()
            loop = asyncio.get_running_loop()
            answered: asyncio.Future[str] = loop.create_future()

            def read() -> None:
                line = sys.stdin.readline()
                loop.call_soon_threadsafe(lambda: answered.done() or answered.set_result(line))

            threading.Thread(target=read, daemon=True).start()
            return (await answered).strip().lower() in ("y", "yes")


class Progress:
    """Tool calls, children and compactions as one line each on stderr."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, event: AgentEvent) -> None:
        if self.quiet:
            return
        indent = "  " * event.session.depth
        if isinstance(event, ChildStarted):
            self.say(f"{indent}▸ subagent {event.child.id}: {event.child.title}")
        elif isinstance(event, MessageAdded) and event.message.role == "tool":
            call = event.message
            self.say(f"{indent}→ {call.name} {call.arguments[:200]}")
        elif isinstance(event, MessageDone) and event.message.role == "tool":
            first = (event.message.content.splitlines() or [""])[0]
            self.say(f"{indent}← {first[:200]}")
        elif isinstance(event, MessageAdded) and event.message.role == "compaction":
            self.say(f"{indent}≡ {marker_line(event.message)}")

    @staticmethod
    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def transcript(store: Store, session: Session) -> dict:
    """A session and its children, as saved."""
    loaded = store.session(session.id) or session
    children = [s for s in store.sessions("subagent") if s.parent_id == session.id]
    return {
        "id": loaded.id,
        "title": loaded.title,
        "status": loaded.status,
        "agent_type": loaded.agent_type,
        "messages": [m.to_json() for m in loaded.messages],
        "children": [transcript(store, child) for child in children],
    }


def check_args(args: argparse.Namespace) -> tuple[Workspace, list[ToolChoice]]:
    """The workspace and tool choices; a ConfigError naming the option that is wrong."""
    if not args.prompt.strip():
        raise ConfigError("-p/--prompt: give the task")
    try:
        workspace = Workspace(args.workspace)
    except ValueError as exc:
        raise ConfigError(f"--workspace: {exc}") from None
    choices = parse_tool_choices(args.tool_choice)
    if args.max_steps < 1:
        raise ConfigError("--max-steps must be at least 1")
    agent_limits(args)  # --compact-at checked before a model loads
    return workspace, choices


def backend_from_args(args: argparse.Namespace) -> tuple[Backend, object | None]:
    """The remote server named by --base-url, else the in-process engine (built here; the
    caller shuts it down). The arguments are checked first: a typo costs no model load."""
    check_args(args)
    if args.base_url:
        return OpenAIBackend(args.base_url, args.api_key), None
    built = build_from_args(args)
    return EngineBackend(lambda: built.engine), built


async def start_mcp(args: argparse.Namespace) -> McpHub | None:
    """The MCP servers of --mcp-config (or the config folder's file), started; None without
    any, or with --no-mcp. A server that fails to start is named on stderr and left off."""
    if args.no_mcp:
        return None
    from lucedesk.agent.mcp import McpHub, default_mcp_config_path, load_mcp_config  # the SDK

    path = Path(args.mcp_config) if args.mcp_config else default_mcp_config_path()
    servers = load_mcp_config(path)
    if not servers:
        return None
    hub = McpHub()
    await hub.start(servers)
    for name, error in hub.errors.items():
        Progress.say(f"lucedesk: MCP server {name} is off: {error}")
    return hub


async def run_agent(args: argparse.Namespace, store: Store, backend: Backend) -> int:
    """Runs the session the arguments describe and prints its answer (or transcript)."""
    workspace, choices = check_args(args)
    ask = TerminalAsk() if sys.stdin.isatty() and not args.json else None
    hub = await start_mcp(args)
    try:
        answer = await run_to_answer(
            backend,
            store,
            workspace,
            args.prompt,
            approvals=Approvals(args.allow_edits, args.allow_commands, ask),
            limits=agent_limits(args),
            agent_type=args.agent,
            system=args.system or "",
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            tool_choices=choices,
            extra_tools=hub.tools if hub is not None else [],
            on_event=Progress(args.json),
        )
    finally:
        if hub is not None:
            await hub.stop()
    if args.json:
        out = {"status": answer.status, "final": answer.text, "error": answer.error}
        out["session"] = transcript(store, answer.session)
        print(json.dumps(out, indent=2, ensure_ascii=False))
    else:
        print(answer.text)
        if answer.status != "done":
            Progress.say(f"lucedesk: the agent ended with {answer.status}: {answer.error}")
    return 0 if answer.status == "done" else 1


def agent(args: argparse.Namespace) -> int:
    """`lucedesk agent`: the exit code is 0 when the agent answered, 1 when it ended otherwise."""
    store = Store(data_dir() / "sessions.db")
    backend, built = backend_from_args(args)
    try:
        return asyncio.run(run_agent(args, store, backend))
    finally:
        if built is not None:
            built.engine.shutdown()
        store.close()
