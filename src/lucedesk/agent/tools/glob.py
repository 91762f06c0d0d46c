"""glob: files of the workspace whose paths match a pattern such as `**/*.py`."""

from __future__ import annotations

import asyncio

from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, capped, schema
from lucedesk.agent.workspace import SKIPPED

MAX_MATCHES = 300


def find(ctx: ToolContext, pattern: str, path: str) -> str:
    base = ctx.workspace.resolve(path)
    if not base.is_dir():
        raise ToolError(f"path: {path} is not a folder")
    if pattern.startswith("/") or ".." in pattern.split("/"):
        raise ToolError("pattern: give a pattern relative to the folder, without '..'")
    try:
        found = base.glob(pattern)
    except ValueError as exc:
        raise ToolError(f"pattern: {exc}") from None
    matches = []
    for p in found:
        if SKIPPED.intersection(p.relative_to(base).parts):
            continue
        real = p.resolve()
        if real.is_relative_to(ctx.workspace.root) and real.is_file():
            matches.append(ctx.workspace.show(p.absolute()))
        if len(matches) > MAX_MATCHES:
            break
    matches.sort()
    if not matches:
        return f"no files match {pattern}"
    more = f" (first {MAX_MATCHES})" if len(matches) > MAX_MATCHES else ""
    return capped(f"{len(matches[:MAX_MATCHES])} files{more}:\n" + "\n".join(matches[:MAX_MATCHES]))


async def glob_files(ctx: ToolContext, args: dict) -> str:
    return await asyncio.to_thread(find, ctx, args["pattern"], args.get("path") or ".")


TOOL = ToolSpec(
    "glob",
    "Find files by path pattern, e.g. '**/*.py' or 'src/*.md' (relative to `path`, default "
    "the workspace root).",
    schema(
        {
            "pattern": {"type": "string"},
            "path": {"type": "string", "description": "folder to search from"},
        },
        ["pattern"],
    ),
    glob_files,
    "read",
)
