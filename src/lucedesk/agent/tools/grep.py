"""grep: lines matching a regular expression, in one file or every text file of a folder.
The pattern is the model's to choose, so it runs on RE2 (as ripgrep's engine does): linear
in the text whatever the pattern, where a backtracking engine can take hours on one line and
hold the process's GIL all that time."""

from __future__ import annotations

import asyncio

import re2

from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, capped, schema
from lucedesk.agent.workspace import SKIPPED

MAX_MATCHES = 200
MAX_FILE_BYTES = 4 * 1024 * 1024  # bigger files are skipped


def search(ctx: ToolContext, pattern: str, path: str, include: str | None, ignore_case: bool):
    regex = compile_pattern(pattern, ignore_case)
    base = ctx.workspace.resolve(path)
    if not base.exists():
        raise ctx.workspace.missing(path)
    if include is not None and (include.startswith("/") or ".." in include.split("/")):
        raise ToolError("include: give a file name pattern such as '*.py', relative, no '..'")
    try:
        files = [base] if base.is_file() else sorted(base.rglob(include or "*"))
    except (ValueError, NotImplementedError) as exc:
        raise ToolError(f"include: {include!r} is not a pattern ({exc})") from None
    matches: list[str] = []
    for f in files:
        if base.is_dir() and SKIPPED.intersection(f.relative_to(base).parts):
            continue
        real = f.resolve()
        if not real.is_file() or not real.is_relative_to(ctx.workspace.root):
            continue
        if real.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            opened = ctx.workspace.open_read(real)
        except ToolError:  # swapped for a link since the walk, or not a regular file
            continue
        if opened is None:
            continue
        with opened:
            data = opened.read(MAX_FILE_BYTES)
        if b"\x00" in data[:8192]:
            continue  # binary
        shown = ctx.workspace.show(f.absolute())
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if regex.search(line):
                matches.append(f"{shown}:{number}: {line[:300]}")
                if len(matches) >= MAX_MATCHES:
                    return capped("\n".join(matches) + f"\n[stopped at {MAX_MATCHES} matches]")
    return capped("\n".join(matches)) if matches else f"no lines match {pattern!r}"


def compile_pattern(pattern: str, ignore_case: bool):
    """The RE2 program for `pattern`; a ToolError naming it when RE2 cannot run it (a
    backreference, a lookaround, a program over its memory bound)."""
    options = re2.Options()
    options.case_sensitive = not ignore_case
    options.log_errors = False
    options.max_mem = 64 << 20
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = (
            exc.args[0].decode(errors="replace")
            if exc.args and isinstance(exc.args[0], bytes)
            else str(exc)
        )
        raise ToolError(
            f"pattern: {pattern!r} cannot be run ({reason}); grep takes RE2 syntax, as "
            "ripgrep does: no backreferences or lookaround"
        ) from None


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
    "Search file contents with a regular expression (RE2 syntax, as ripgrep: no backreferences "
    "or lookaround). Answers path:line: text. "
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
