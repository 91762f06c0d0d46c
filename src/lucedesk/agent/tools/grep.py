"""grep: lines matching a regular expression, in one file or every text file of a folder."""

from __future__ import annotations

import asyncio
import re

from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, capped, schema
from lucedesk.agent.workspace import SKIPPED

MAX_MATCHES = 200
MAX_FILE_BYTES = 4 * 1024 * 1024  # bigger files are skipped


def search(ctx: ToolContext, pattern: str, path: str, include: str | None, ignore_case: bool):
    try:
        regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        raise ToolError(f"pattern: not a valid regular expression ({exc})") from None
    base = ctx.workspace.resolve(path)
    if not base.exists():
        raise ctx.workspace.missing(path)
    files = [base] if base.is_file() else sorted(base.rglob(include or "*"))
    matches: list[str] = []
    for f in files:
        if base.is_dir() and SKIPPED.intersection(f.relative_to(base).parts):
            continue
        real = f.resolve()
        if not real.is_file() or not real.is_relative_to(ctx.workspace.root):
            continue
        if real.stat().st_size > MAX_FILE_BYTES:
            continue
        data = real.read_bytes()
        if b"\x00" in data[:8192]:
            continue  # binary
        shown = ctx.workspace.show(f.absolute())
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if regex.search(line):
                matches.append(f"{shown}:{number}: {line[:300]}")
                if len(matches) >= MAX_MATCHES:
                    return capped("\n".join(matches) + f"\n[stopped at {MAX_MATCHES} matches]")
    return capped("\n".join(matches)) if matches else f"no lines match {pattern!r}"


async def grep(ctx: ToolContext, args: dict) -> str:
    return await asyncio.to_thread(
        search,
        ctx,
        args["pattern"],
        args.get("path") or ".",
        args.get("include"),
        bool(args.get("ignore_case", False)),
    )


TOOL = ToolSpec(
    "grep",
    "Search file contents with a regular expression (Python syntax). Answers path:line: text. "
    "`path` is a file or folder (default the workspace root); `include` a file name pattern "
    "such as '*.py'.",
    schema(
        {
            "pattern": {"type": "string"},
            "path": {"type": "string"},
            "include": {"type": "string"},
            "ignore_case": {"type": "boolean"},
        },
        ["pattern"],
    ),
    grep,
    "read",
)
