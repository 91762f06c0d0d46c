"""edit_file: replace an exact string in a file, after the user approves the diff."""

from __future__ import annotations

import asyncio

from lucedesk.agent.tools.base import ToolContext, ToolError, ToolSpec, schema
from lucedesk.agent.tools.write_file import apply_change, current_text


async def edit_file(ctx: ToolContext, args: dict) -> str:
    real = ctx.workspace.resolve(args["path"])
    old, new = args["old_string"], args["new_string"]
    if not real.exists():
        raise ToolError(f"path: {args['path']} does not exist; use write_file to create it")
    if old == "":
        raise ToolError("old_string: give the exact text to replace")
    if old == new:
        raise ToolError("new_string: it is the same as old_string")
    for field, text in (("old_string", old), ("new_string", new)):
        if any("\ud800" <= c <= "\udfff" for c in text):
            raise ToolError(f"{field}: holds a lone surrogate, which is no text a file holds")
    before = await asyncio.to_thread(current_text, ctx.workspace, real)
    count = before.count(old)
    if count == 0:
        raise ToolError(f"old_string: not found in {args['path']} (it must match exactly)")
    if count > 1 and not args.get("replace_all", False):
        raise ToolError(
            f"old_string: found {count} times in {args['path']}; add context to make it "
            "unique, or set replace_all"
        )
    return await apply_change(ctx, "edit_file", real, before, before.replace(old, new))


TOOL = ToolSpec(
    "edit_file",
    "Replace exact text in a file: old_string must appear exactly once (or set replace_all).",
    schema(
        {
            "path": {"type": "string"},
            "old_string": {"type": "string"},
            "new_string": {"type": "string"},
            "replace_all": {"type": "boolean"},
        },
        ["path", "old_string", "new_string"],
    ),
    edit_file,
    "write",
)
