"""list_dir: what a folder holds, folders first, with file sizes."""

from __future__ import annotations

import asyncio

from lucedesk.agent.tools.base import ToolContext, ToolSpec, capped, schema

MAX_ENTRIES = 500


def list_entries(ctx: ToolContext, path: str) -> str:
    real = ctx.workspace.resolve(path)
    if not real.exists():
        raise ctx.workspace.missing(path)
    if not real.is_dir():  # as `ls FILE` does: the file itself
        size = real.stat().st_size
        return f"{ctx.workspace.show(real)}  ({size} bytes; a file: read_file reads it)"
    entries = sorted(real.iterdir(), key=lambda p: (not p.is_dir(), p.name))
    lines = []
    for entry in entries[:MAX_ENTRIES]:
        if entry.is_symlink() and not entry.resolve().is_relative_to(ctx.workspace.root):
            lines.append(f"{entry.name} (a link out of the workspace)")  # nothing of its target
        elif entry.is_dir():
            lines.append(f"{entry.name}/")
        elif entry.is_symlink() and not entry.exists():
            lines.append(f"{entry.name} (broken link)")
        else:
            lines.append(f"{entry.name}  ({entry.stat().st_size} bytes)")
    header = f"{ctx.workspace.show(real)}: {len(entries)} entries"
    if len(entries) > MAX_ENTRIES:
        header += f" (first {MAX_ENTRIES} shown)"
    if not entries:
        header += " (empty)"
    return capped("\n".join([header, *lines]))


async def list_dir(ctx: ToolContext, args: dict) -> str:
    return await asyncio.to_thread(list_entries, ctx, args.get("path") or ".")


TOOL = ToolSpec(
    "list_dir",
    "List a folder of the workspace (default: its root). Folders end with '/'.",
    schema({"path": {"type": "string", "description": "folder; '.' is the workspace root"}}, []),
    list_dir,
    "read",
)
