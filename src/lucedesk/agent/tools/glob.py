"""glob: files of the workspace whose paths match a pattern such as `**/*.py`."""

from __future__ import annotations

import asyncio
import re

from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, capped, schema

MAX_MATCHES = 300


def pattern_regex(pattern: str) -> re.Pattern:
    """A path pattern as pathlib reads one: `**` any folders (none too), `*` and `?` within
    a name, `[...]` a set; names starting with a dot match too."""
    parts = []
    for i, segment in enumerate(pattern.split("/")):
        last = i == len(pattern.split("/")) - 1
        if segment == "**":
            parts.append("(?:[^/]+/)*[^/]+" if last else "(?:[^/]+/)*")
            continue
        out, j = "", 0
        while j < len(segment):
            c = segment[j]
            if c == "*":
                out += "[^/]*"
            elif c == "?":
                out += "[^/]"
            elif c == "[" and "]" in segment[j + 2 :]:
                end = segment.index("]", j + 2)
                body = segment[j + 1 : end]
                out += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
                j = end
            else:
                out += re.escape(c)
            j += 1
        parts.append(out if last else out + "/")
    try:
        return re.compile("".join(parts) + r"\Z")
    except re.error as exc:
        raise ToolError(f"pattern: {exc}") from None


def find(ctx: ToolContext, pattern: str, path: str) -> str:
    ws = ctx.workspace
    base = ws.resolve(path)
    if not base.is_dir():
        raise ToolError(f"path: {path} is not a folder")
    if pattern.startswith("/") or ".." in pattern.split("/"):
        raise ToolError("pattern: give a pattern relative to the folder, without '..'")
    wanted = pattern_regex(pattern)
    matches = []
    for relative in ws.walk_files(base):  # through descriptors, into no link
        if wanted.match(relative):
            matches.append(ws.show(base / relative))
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
