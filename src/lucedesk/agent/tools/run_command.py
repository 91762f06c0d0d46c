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
EXIT_POLL_S = 0.02
OUTPUT_GRACE_S = 2.0  # after the exit, for a process outside the group that holds the output


def kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Output:
    """What a command wrote: the first MAX_OUTPUT_BYTES, and a count of the rest."""

    def __init__(self) -> None:
        self.kept = bytearray()
        self.dropped = 0


async def read_capped(stream: asyncio.StreamReader, out: Output) -> None:
    while chunk := await stream.read(65536):
        room = MAX_OUTPUT_BYTES - len(out.kept)
        out.kept += chunk[:room]
        out.dropped += max(0, len(chunk) - room)


async def wait_exit(proc: asyncio.subprocess.Process, timeout: float) -> bool:
    """Whether the shell exits within `timeout`. Not `proc.wait()`: before Python 3.12 that
    also waits for the output pipe to close, which a background child (`server &`) holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while proc.returncode is None:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(EXIT_POLL_S)
    return True


async def run_command(ctx: ToolContext, args: dict) -> str:
    command = args["command"]
    timeout = args.get("timeout", DEFAULT_TIMEOUT_S)
    if not command.strip():
        raise ToolError("command: give a command to run")
    request = ApprovalRequest("command", ctx.title, "run_command", f"run: {command}", command)
    if not await ctx.approve(request):
        raise ToolError(f"the user declined to run: {command}")
    proc = await asyncio.create_subprocess_shell(
        command,
        cwd=ctx.workspace.root,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group, so a kill takes its children too
    )
    out = Output()
    reader = asyncio.ensure_future(read_capped(proc.stdout, out))
    try:
        exited = await wait_exit(proc, timeout)
        kill_group(proc)  # the command on a timeout; else what it left running in the background
        # A process that left the group (setsid) may hold the output open: not for long.
        await asyncio.wait({reader}, timeout=OUTPUT_GRACE_S)
    except asyncio.CancelledError:
        kill_group(proc)
        reader.cancel()
        raise
    note = "" if exited else f"timed out after {timeout} s"
    if reader.cancel():  # still reading: the output so far is what there is
        proc._transport.close()  # lets go of the pipe (asyncio has no public way)
        note = (note or f"exit code {proc.returncode}") + (
            "; a process it started outside its group still holds the output open"
        )
    return format_output(command, proc.returncode, bytes(out.kept), out.dropped, note)


def format_output(
    command: str, code: int | None, output: bytes, dropped: int, note: str = ""
) -> str:
    status = note or f"exit code {code}"
    text = output.decode("utf-8", errors="replace")
    result = capped(f"$ {command}\n{status}\n{text}".rstrip())
    if dropped:  # after the cap, so the note is never cut off
        result += f"\n[... {dropped} more bytes of output not kept]"
    return result


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
