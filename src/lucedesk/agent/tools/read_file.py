"""read_file: a text file's lines under a header naming the range, a window at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import BinaryIO

from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, capped, schema

MAX_READ_BYTES = 2 * 1024 * 1024  # larger files are read a window at a time, never whole
DEFAULT_LINES = 400
MAX_LINE_CHARS = 1000
MAX_LINE_BYTES = 64 << 20  # reading stops inside a longer line


def bounded_lines(f: BinaryIO) -> Iterator[tuple[bytes, int, bool]]:
    """(the line's first bytes, its length, whether it ended) for each line of `f`, in
    memory bounded by the line cap: a long line is skipped through a megabyte at a time,
    never held; one longer than MAX_LINE_BYTES (a sparse or generated file) ends the
    reading there, unfinished."""
    keep = MAX_LINE_CHARS * 4  # UTF-8: up to 4 bytes a character
    while chunk := f.readline(keep + 1):
        if chunk.endswith(b"\n") or len(chunk) <= keep:  # the whole line (or the last)
            yield chunk, len(chunk), True
            continue
        head, size = chunk, len(chunk)
        while not chunk.endswith(b"\n") and (chunk := f.readline(1 << 20)):
            size += len(chunk)
            if size > MAX_LINE_BYTES:
                yield head, size, False
                return
        yield head, size, True


def read_lines(ctx: ToolContext, path: str, offset: int, limit: int) -> str:
    real = ctx.workspace.resolve(path)
    if not real.exists():
        raise ctx.workspace.missing(path)
    if real.is_dir():
        raise ToolError(f"path: {path} is a folder; use list_dir")
    f = ctx.workspace.open_read(real)  # a FIFO or a device (would block) is refused
    if f is None:
        raise ctx.workspace.missing(path)
    lines: list[str] = []
    total = 0
    with f:
        head = f.read(8192)
        if b"\x00" in head:
            raise ToolError(f"path: {path} is a binary file")
        f.seek(0)
        read = 0
        for number, (raw, size, ended) in enumerate(bounded_lines(f), start=1):
            total = number
            read += size
            if offset <= number < offset + limit:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if len(line) > MAX_LINE_CHARS or size > len(raw):
                    line = line[:MAX_LINE_CHARS] + " [line cut]"
                lines.append(line)
            elif number >= offset + limit and read > MAX_READ_BYTES:
                total = -1  # stopped counting
                break
            if not ended:  # where the next line starts is not known without reading on
                total = -1
                break
    if not lines and total == -1:
        raise ToolError(
            f"offset: line {offset} lies past a line of over {MAX_LINE_BYTES >> 20} MiB; "
            "nothing after that line is read"
        )
    if not lines and total > 0:
        raise ToolError(f"offset: the file has {total} lines")
    shown = ctx.workspace.show(real)
    last = offset + len(lines) - 1
    if total == -1:
        note = f"{shown}: lines {offset}-{last} (more follow; read on with offset={last + 1})"
    elif last < total:
        note = f"{shown}: lines {offset}-{last} of {total} (read on with offset={last + 1})"
    else:
        note = f"{shown}: {total} lines" if offset == 1 else f"{shown}: lines {offset}-{last}"
    return capped(note + "\n" + "\n".join(lines))


async def read_file(ctx: ToolContext, args: dict) -> str:
    offset = args.get("offset", 1)
    limit = args.get("limit", DEFAULT_LINES)
    return await asyncio.to_thread(read_lines, ctx, args["path"], offset, limit)


TOOL = ToolSpec(
    "read_file",
    "Read a text file in the workspace; long files a window at a time "
    f"(offset = first line, 1-based; limit = number of lines, default {DEFAULT_LINES}).",
    schema(
        {
            "path": {"type": "string", "description": "file path, relative to the workspace"},
            "offset": {"type": "integer", "minimum": 1},
            "limit": {"type": "integer", "minimum": 1, "maximum": 2000},
        },
        ["path"],
    ),
    read_file,
    "read",
)
