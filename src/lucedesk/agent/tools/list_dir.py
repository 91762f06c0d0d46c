"""list_dir: what a folder holds, folders first, with file sizes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from lucedesk.agent.tools.base import ToolContext, ToolSpec, capped, schema

MAX_ENTRIES = 500


def list_entries(ctx: ToolContext, path: str) -> str:
    ws = ctx.workspace
    real = ws.resolve(path)
    if not real.exists():
        raise ws.missing(path)
    if not real.is_dir():  # as `ls FILE` does: the file itself
        size = real.stat().st_size
        return f"{ws.show(real)}  ({size} bytes; a file: read_file reads it)"
    fd = ws.open_dir(real)  # listed through its descriptor: a swapped link is refused
    try:
        with os.scandir(fd) as found:
            entries = sorted(found, key=lambda e: (not _sorts_as_folder(e), e.name))
        lines = [_line(ws, real, entry, fd) for entry in entries[:MAX_ENTRIES]]
    finally:
        os.close(fd)
    header = f"{ws.show(real)}: {len(entries)} entries"
    if len(entries) > MAX_ENTRIES:
        header += f" (first {MAX_ENTRIES} shown)"
    if not entries:
        header += " (empty)"
    return capped("\n".join([header, *lines]))


def _inside(ws, folder: Path, entry: os.DirEntry) -> Path | None:
    """Where a link leads, if that is inside the workspace."""
    target = (folder / entry.name).resolve()
    return target if target.is_relative_to(ws.root) else None


def _sorts_as_folder(entry: os.DirEntry) -> bool:
    try:  # a link to a folder sorts with the folders, wherever it leads
        return entry.is_dir()
    except OSError:
        return False


def _line(ws, folder: Path, entry: os.DirEntry, fd: int) -> str:
    if entry.is_symlink():
        target = _inside(ws, folder, entry)
        if target is None:
            return f"{entry.name} (a link out of the workspace)"  # nothing of its target
        if not target.exists():
            return f"{entry.name} (broken link)"
        if target.is_dir():
            return f"{entry.name}/"
        return f"{entry.name}  ({target.stat().st_size} bytes)"
    if entry.is_dir(follow_symlinks=False):
        return f"{entry.name}/"
    size = os.stat(entry.name, dir_fd=fd, follow_symlinks=False).st_size
    return f"{entry.name}  ({size} bytes)"


async def list_dir(ctx: ToolContext, args: dict) -> str:
    return await asyncio.to_thread(list_entries, ctx, args.get("path") or ".")


TOOL = ToolSpec(
    "list_dir",
    "List a folder of the workspace (default: its root). Folders end with '/'.",
    schema({"path": {"type": "string", "description": "folder; '.' is the workspace root"}}, []),
    list_dir,
    "read",
)
