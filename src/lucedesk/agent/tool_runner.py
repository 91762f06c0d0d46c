"""Running one model turn's tool calls: each call stored as a tool message when it starts and
given its result when it ends; arguments checked against the tool's schema; a ToolError, a
tool's own bug or a call to a tool the session lacks all become a result the model reads, so
the loop goes on. Approvals are asked inside the tools that write or run (ToolContext)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

import jsonschema

from lucedesk.agent.events import MessageAdded, MessageDone
from lucedesk.agent.tool_error import ToolError
from lucedesk.agent.tools.base import ToolContext, ToolSpec
from lucedesk.chat import ToolCall
from lucedesk.store import StoredMessage

if TYPE_CHECKING:
    from lucedesk.agent.live import LiveSession

log = logging.getLogger(__name__)

# (the call, its stored tool message, its tool or None when the session may not call it)
Pending = tuple[ToolCall, StoredMessage, ToolSpec | None]


async def run_calls(
    session: LiveSession, calls: list[ToolCall], specs: dict[str, ToolSpec] | None = None
) -> None:
    """Runs one turn's calls (`specs`: the tools by name, the session's own by default). Calls
    that only look (and task calls) run together; one that writes or runs something runs
    alone, in the order the model wrote them."""
    specs = specs if specs is not None else {t.name: t for t in session.tools()}
    pending = []
    for call in calls:
        message = session.store.add_message(
            session.record,
            StoredMessage(
                "tool",
                "",
                "streaming",
                tool_call_id=call.id,
                name=call.name,
                arguments=call.arguments,
            ),
        )
        session.runtime.emit(MessageAdded(session, message))
        pending.append((call, message))
    children = 0
    batch: list[Pending] = []
    for call, message in pending:
        spec = specs.get(call.name)
        if spec is not None and spec.access == "task":
            children += 1
            if children > session.runtime.limits.max_children:
                spec = None  # reported as too many below
        together = spec is not None and spec.access in ("read", "task")
        if not together and batch:
            await _run_batch(session, batch)
            batch = []
        batch.append((call, message, spec))
        if not together:
            await _run_batch(session, batch)
            batch = []
    if batch:
        await _run_batch(session, batch)


async def _run_batch(session: LiveSession, batch: list[Pending]) -> None:
    names = ", ".join(call.name for call, _, _ in batch)
    session.set_phase(f"tool {names}" if len(batch) < 3 else f"{len(batch)} tools")
    await asyncio.gather(
        *(_run_call(session, call, message, spec) for call, message, spec in batch)
    )


async def _run_call(
    session: LiveSession, call: ToolCall, message: StoredMessage, spec: ToolSpec | None
) -> None:
    try:
        text = await call_tool(session, call, spec)
    except ToolError as exc:
        text = message.error = f"error: {exc}"
    except asyncio.CancelledError:
        message.error = "cancelled"
        session.store.update_reply(message, "cancelled", "done")
        session.runtime.emit(MessageDone(session, message))
        raise
    except Exception as exc:  # a tool's own bug: the model and the log hear of it
        log.exception("tool %s failed", call.name)
        text = message.error = f"error: the tool failed ({type(exc).__name__}: {exc})"
    session.store.update_reply(message, text, "done")
    session.runtime.emit(MessageDone(session, message))


async def call_tool(session: LiveSession, call: ToolCall, spec: ToolSpec | None) -> str:
    """The result of one call; a ToolError the model reads when the tool is not there, the
    arguments do not fit its schema, or the tool itself refuses."""
    if spec is None:
        names = ", ".join(t.name for t in session.tools()) or "none"
        if call.name == "task":
            raise ToolError(
                f"too many task calls in one turn (at most {session.runtime.limits.max_children})"
                if any(t.name == "task" for t in session.tools())
                else "task: the depth limit is reached; do this work yourself"
            )
        raise ToolError(f"unknown tool {call.name!r}; the tools are: {names}")
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError as exc:
        raise ToolError(f"arguments: not valid JSON ({exc})") from None
    problem = jsonschema.Draft202012Validator(spec.parameters).iter_errors(args)
    first = jsonschema.exceptions.best_match(problem)
    if first is not None:
        where = "/".join(str(p) for p in first.absolute_path) or "arguments"
        raise ToolError(f"{where}: {first.message} (the arguments of {spec.name})")
    workspace = session.workspace
    if workspace is None and spec.access != "task":
        raise ToolError("this session has no workspace")
    ctx = ToolContext(
        workspace, session.runtime.approvals, session.title, session.run_child, session
    )
    try:
        return await spec.handler(ctx, args)
    except OSError as exc:  # a file that went away mid-call, a name too long: the model's
        raise ToolError(os_error_text(exc, workspace, args)) from None


def os_error_text(exc: OSError, workspace, args: dict) -> str:
    """What the file system said, naming the path (relative to the workspace)."""
    where = exc.filename or args.get("path") or "."
    if workspace is not None:
        try:
            where = workspace.show(workspace.root.joinpath(where).resolve())
        except (OSError, ValueError, RuntimeError):
            pass
    return f"path: {where}: {exc.strerror or exc}"
