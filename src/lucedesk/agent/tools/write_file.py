"""write_file: create a file or replace its whole content, after the user approves the diff."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import os
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from lucedesk.agent.approvals import ApprovalRequest
from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, schema

if TYPE_CHECKING:
    from lucedesk.agent.workspace import Workspace

MAX_WRITE_CHARS = 1_000_000


def unified_diff(shown: str, before: str, after: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"a/{shown}",
        tofile=f"b/{shown}",
    )
    text = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    # Bytes that are not UTF-8 (kept as escapes, see current_text) are shown as U+FFFD.
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def current_text(ws: Workspace, real: Path, field: str = "path") -> str:
    if real.is_dir():
        raise ToolError(f"{field}: {real.name} is a folder")
    data = ws.read_for_write(real, field)  # refuses binary files and big ones
    if data is None:
        return ""
    # Bytes that are not UTF-8 (a Latin-1 file, a stray byte) ride along as surrogate
    # escapes and are written back as they were: an edit changes only what it replaces.
    return data.decode("utf-8", errors="surrogateescape")


async def apply_change(ctx: ToolContext, tool: str, real: Path, before: str, after: str) -> str:
    """Shows the diff for approval, then writes `after`; the result names what changed."""
    shown = ctx.workspace.show(real)
    diff = unified_diff(shown, before, after)
    if not diff:
        return f"{shown}: unchanged (the new content is the same)"
    # Hooks and config there run commands; case-folded, as case-insensitive file systems
    # (macOS, Windows) find .git under .GIT.
    if any(part.casefold() == ".git" for part in Path(shown).parts):
        raise ToolError(f"path: {shown} is inside .git; lucedesk does not write there")
    verb = "edit" if real.exists() else "create"
    request = ApprovalRequest("edit", ctx.title, tool, f"{verb} {shown}", diff)
    if not await ctx.approve(request):
        raise ToolError(f"the user declined to {verb} {shown}")
    if not await asyncio.to_thread(write_if_unchanged, ctx.workspace, real, before, after):
        # another edit landed while this one waited for its approval: writing now would undo it
        raise ToolError(f"{shown} changed while this change waited for approval; read it again")
    added = sum(1 for line in diff.splitlines() if line.startswith("+") and line[:3] != "+++")
    removed = sum(1 for line in diff.splitlines() if line.startswith("-") and line[:3] != "---")
    done = "edited" if verb == "edit" else "created"
    return f"{shown}: {done} (+{added} -{removed} lines)"


def write_if_unchanged(ws: Workspace, real: Path, before: str, after: str) -> bool:
    """Writes `after` unless the file no longer holds `before`; False when it changed. The
    new content goes to a fresh file in the same folder descriptor, renamed over the old
    one: nothing is written through a link or a second hard link."""
    if current_text(ws, real) != before:
        return False
    dir_fd, name = ws.open_parent(real, create=True)
    try:
        mode = 0o644
        with contextlib.suppress(FileNotFoundError):
            mode = stat.S_IMODE(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        # beside it, under a name of its own: `.{name}.x` would pass the 255 bytes a name
        # may have for names of 240 and more
        fresh = f".lucedesk-{secrets.token_hex(4)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(fresh, flags, mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(after.encode("utf-8", "surrogateescape"))
            os.replace(fresh, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(fresh, dir_fd=dir_fd)
            raise
    except FileNotFoundError:  # the folder was removed after it was opened
        gone = f"path: {ws.show(real)} changed while in use (its folder is gone)"
        raise ToolError(gone) from None
    finally:
        os.close(dir_fd)
    return True


async def write_file(ctx: ToolContext, args: dict) -> str:
    real = ctx.workspace.resolve(args["path"])
    content = args["content"]
    if len(content) > MAX_WRITE_CHARS:
        raise ToolError(f"content: at most {MAX_WRITE_CHARS} characters")
    if any("\ud800" <= c <= "\udfff" for c in content):
        raise ToolError("content: holds a lone surrogate, which is no text a file can hold")
    before = await asyncio.to_thread(current_text, ctx.workspace, real)
    return await apply_change(ctx, "write_file", real, before, content)


TOOL = ToolSpec(
    "write_file",
    "Create a file, or replace a file's whole content (folders are created). Prefer edit_file "
    "for changes to an existing file.",
    schema({"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    write_file,
    "write",
)
