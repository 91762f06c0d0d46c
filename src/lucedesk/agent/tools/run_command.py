"""run_command: a shell command in the workspace, after the user approves it. Output is
capped, a timeout kills it, and so does cancelling the session: the whole process group."""

from __future__ import annotations

import asyncio
import os
import signal

from lucedesk.agent.approvals import ApprovalRequest
from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, capped, schema

DEFAULT_TIMEOUT_S = 60
MAX_TIMEOUT_S = 600
MAX_OUTPUT_BYTES = 64 * 1024  # kept; the rest is read and counted, not stored


def kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def read_capped(stream: asyncio.StreamReader) -> tuple[bytes, int]:
    kept = bytearray()
    dropped = 0
    while chunk := await stream.read(65536):
        room = MAX_OUTPUT_BYTES - len(kept)
        kept += chunk[:room]
        dropped += max(0, len(chunk) - room)
    return bytes(kept), dropped


async def run_command(ctx: ToolContext, args: dict) -> str:
    command = args["command"]
    timeout = args.get("timeout", DEFAULT_TIMEOUT_S)
    if not command.strip():
        raise ToolError("command: give a command to run")
    request = ApprovalRequest(
        "command", ctx.session.title, "run_command", f"run: {command}", command
    )
    if not await ctx.approvals.approve(request):
        raise ToolError(f"the user declined to run: {command}")
    proc = await asyncio.create_subprocess_shell(
        command,
        cwd=ctx.workspace.root,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group, so a kill takes its children too
    )
    reader = asyncio.ensure_future(read_capped(proc.stdout))
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
    except TimeoutError:
        kill_group(proc)
        await proc.wait()
        output, dropped = await reader
        return format_output(command, None, output, dropped, f"timed out after {timeout} s")
    except asyncio.CancelledError:
        kill_group(proc)
        reader.cancel()
        raise
    kill_group(proc)  # what it left running in the background goes too
    output, dropped = await reader
    return format_output(command, proc.returncode, output, dropped)


def format_output(
    command: str, code: int | None, output: bytes, dropped: int, note: str = ""
) -> str:
    status = note or f"exit code {code}"
    text = output.decode("utf-8", errors="replace")
    if dropped:
        text += f"\n[... {dropped} more bytes of output not kept]"
    return capped(f"$ {command}\n{status}\n{text}".rstrip())


TOOL = ToolSpec(
    "run_command",
    "Run a shell command in the workspace folder and read its output (stdout and stderr "
    f"together). Asks the user first. Default timeout {DEFAULT_TIMEOUT_S} s.",
    schema(
        {
            "command": {"type": "string"},
            "timeout": {"type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT_S},
        },
        ["command"],
    ),
    run_command,
    "exec",
)
