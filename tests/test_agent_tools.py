"""The built-in agent tools, called directly: confinement to the workspace, reading in
windows, listing and searching, edits behind approval with a diff, and commands that are
approved, captured, capped, timed out and cancelled with their whole process group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from lucedesk.agent.approvals import ApprovalRequest, Approvals
from lucedesk.agent.tools import edit_file, glob, grep, list_dir, read_file, run_command, write_file
from lucedesk.agent.tools.base import ToolContext, ToolError
from lucedesk.agent.workspace import Workspace

TOOLS = {
    t.name: t
    for t in (read_file.TOOL, write_file.TOOL, edit_file.TOOL, list_dir.TOOL, grep.TOOL, glob.TOOL)
}
SECRET = "the secret is 42\n"


@pytest.fixture
def ws(tmp_path) -> Path:
    """tmp_path/ws is the workspace; tmp_path/outside is not, and links lead there."""
    root = tmp_path / "ws"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    (root / "notes.txt").write_text("hello notes\n")
    (root / "docs").mkdir()
    (root / "docs" / "readme.md").write_text("hello readme\n")
    (root / "out").symlink_to(outside, target_is_directory=True)
    (root / "secret_link.txt").symlink_to(outside / "secret.txt")
    (root / "inner").symlink_to(root / "docs", target_is_directory=True)
    return root


def context(root: Path, approvals: Approvals | None = None) -> ToolContext:
    return ToolContext(Workspace(root), approvals or Approvals(), "tools")


class Recorder:
    """An `ask` that records each request and answers `answer`."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.requests: list[ApprovalRequest] = []

    async def __call__(self, request: ApprovalRequest) -> bool:
        self.requests.append(request)
        return self.answer


async def never_ask(request: ApprovalRequest) -> bool:
    raise AssertionError(f"asked although allowed up front: {request}")


# -- confinement ----------------------------------------------------------------------------


def escape(kind: str, tmp_path: Path, folder: bool) -> str:
    """A path that leaves the workspace: through '..', absolute, or through a link."""
    name = "" if folder else "/secret.txt"
    return {
        "dotdot": f"../outside{name}",
        "absolute": f"{tmp_path / 'outside'}{name}",
        "dir_link": f"out{name}",
        "file_link": "secret_link.txt",
    }[kind]


ARGS = {
    "read_file": lambda p: {"path": p},
    "write_file": lambda p: {"path": p, "content": "overwritten\n"},
    "edit_file": lambda p: {"path": p, "old_string": "secret", "new_string": "leaked"},
    "list_dir": lambda p: {"path": p},
    "grep": lambda p: {"pattern": "secret", "path": p},
    "glob": lambda p: {"pattern": "*", "path": p},
}


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "dir_link", "file_link"])
@pytest.mark.parametrize("name", list(ARGS))
async def test_paths_outside_the_workspace_are_refused(ws, tmp_path, name, kind):
    path = escape(kind, tmp_path, folder=name in ("list_dir", "grep", "glob"))
    ctx = context(ws, Approvals(allow_edits=True, ask=never_ask))
    with pytest.raises(ToolError, match=r"^path: .* is outside the workspace"):
        await TOOLS[name].handler(ctx, ARGS[name](path))
    assert (tmp_path / "outside" / "secret.txt").read_text() == SECRET
    assert [p.name for p in (tmp_path / "outside").iterdir()] == ["secret.txt"]


async def test_new_files_outside_the_workspace_are_not_created(ws, tmp_path):
    ctx = context(ws, Approvals(allow_edits=True))
    for path in ["../outside/new.txt", str(tmp_path / "outside" / "new.txt"), "out/new.txt"]:
        with pytest.raises(ToolError, match="^path: .* is outside the workspace"):
            await write_file.TOOL.handler(ctx, {"path": path, "content": "x"})
    assert not (tmp_path / "outside" / "new.txt").exists()


async def test_a_folder_swapped_for_a_link_mid_write_lets_nothing_out(ws, tmp_path):
    """A racing process flips `sub` between a folder and a link to a folder outside while
    200 writes go into it: none lands outside."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ctx = context(ws, Approvals(allow_edits=True))
    stop = threading.Event()

    def flip():
        sub, aside = ws / "sub", ws / "aside"
        while not stop.is_set():
            with contextlib.suppress(OSError):
                sub.rename(aside)  # the real folder steps aside, a link takes its name
                sub.symlink_to(outside, target_is_directory=True)
                time.sleep(0.0002)
                sub.unlink()
                aside.rename(sub)
                time.sleep(0.0002)

    (ws / "sub").mkdir()
    flipper = threading.Thread(target=flip)
    flipper.start()
    written = refused = 0
    try:
        for i in range(200):
            try:
                await write_file.TOOL.handler(ctx, {"path": f"sub/f{i}.txt", "content": "x"})
                written += 1
            except ToolError:
                refused += 1
    finally:
        stop.set()
        flipper.join()
    assert list(outside.iterdir()) == []
    assert written + refused == 200
    # how many of the 200 met the link depends on the machine's timing; once the flipping
    # stops, the same write lands where it should
    await write_file.TOOL.handler(ctx, {"path": "sub/after.txt", "content": "x"})
    assert (ws / "sub" / "after.txt").read_text() == "x"


async def test_a_hard_link_to_a_file_outside_is_not_written_through(ws, tmp_path):
    secret = tmp_path / "kept.txt"
    secret.write_text("keep me\n")
    os.link(secret, ws / "linked.txt")
    ctx = context(ws, Approvals(allow_edits=True))
    for tool, args in [
        (write_file, {"path": "linked.txt", "content": "changed"}),
        (edit_file, {"path": "linked.txt", "old_string": "keep", "new_string": "lose"}),
    ]:
        with pytest.raises(ToolError, match="has other hard links"):
            await tool.TOOL.handler(ctx, args)
    assert secret.read_text() == "keep me\n"


async def test_a_glob_pattern_cannot_climb_out(ws):
    with pytest.raises(ToolError, match="^pattern: "):
        await glob.TOOL.handler(context(ws), {"pattern": "../outside/*"})


async def test_searches_of_the_whole_workspace_do_not_follow_links_out(ws):
    ctx = context(ws)
    assert await grep.TOOL.handler(ctx, {"pattern": "secret"}) == "no lines match 'secret'"
    found = await glob.TOOL.handler(ctx, {"pattern": "**/*"})
    assert "secret" not in found and "out/" not in found
    assert "notes.txt" in found and "docs/readme.md" in found


async def test_a_link_inside_to_inside_works_for_every_tool(ws):
    ctx = context(ws, Approvals(allow_edits=True))
    assert "hello readme" in await read_file.TOOL.handler(ctx, {"path": "inner/readme.md"})
    assert "readme.md" in await list_dir.TOOL.handler(ctx, {"path": "inner"})
    assert "readme.md:1: hello readme" in await grep.TOOL.handler(
        ctx, {"pattern": "readme", "path": "inner"}
    )
    assert "readme.md" in await glob.TOOL.handler(ctx, {"pattern": "*.md", "path": "inner"})
    await edit_file.TOOL.handler(
        ctx, {"path": "inner/readme.md", "old_string": "hello", "new_string": "hi"}
    )
    await write_file.TOOL.handler(ctx, {"path": "inner/new.md", "content": "new\n"})
    assert (ws / "docs" / "readme.md").read_text() == "hi readme\n"
    assert (ws / "docs" / "new.md").read_text() == "new\n"


async def test_a_symlink_loop_is_a_tool_error_naming_the_field(ws):
    (ws / "loop_a").symlink_to(ws / "loop_b")
    (ws / "loop_b").symlink_to(ws / "loop_a")
    with pytest.raises(ToolError, match="^path: loop_a"):
        await read_file.TOOL.handler(context(ws), {"path": "loop_a"})


# -- read_file ------------------------------------------------------------------------------


async def test_read_file_reads_a_window_and_says_where_to_read_on(ws):
    (ws / "lines.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    ctx = context(ws)
    text = await read_file.TOOL.handler(ctx, {"path": "lines.txt", "offset": 3, "limit": 4})
    assert text.splitlines() == [
        "lines.txt: lines 3-6 of 10 (read on with offset=7)",
        "line 3",
        "line 4",
        "line 5",
        "line 6",
    ]
    whole = await read_file.TOOL.handler(ctx, {"path": "lines.txt"})
    assert whole.splitlines()[0] == "lines.txt: 10 lines" and len(whole.splitlines()) == 11
    tail = await read_file.TOOL.handler(ctx, {"path": "lines.txt", "offset": 8, "limit": 5})
    assert tail.splitlines() == ["lines.txt: lines 8-10", "line 8", "line 9", "line 10"]
    with pytest.raises(ToolError, match="^offset: the file has 10 lines"):
        await read_file.TOOL.handler(ctx, {"path": "lines.txt", "offset": 11})


async def test_read_file_reads_long_files_400_lines_at_a_time(ws):
    (ws / "long.txt").write_text("".join(f"{i}\n" for i in range(1, 1001)))
    text = await read_file.TOOL.handler(context(ws), {"path": "long.txt"})
    assert text.splitlines()[0] == "long.txt: lines 1-400 of 1000 (read on with offset=401)"
    assert text.splitlines()[-1] == "400"


async def test_read_file_cuts_very_long_lines(ws):
    (ws / "wide.txt").write_text("x" * 5000 + "\nshort\n")
    text = await read_file.TOOL.handler(context(ws), {"path": "wide.txt"})
    assert text.splitlines()[1] == "x" * 1000 + " [line cut]"
    assert text.splitlines()[2] == "short"


async def test_a_huge_sparse_file_is_read_in_bounded_memory(ws):
    text = "".join(f"line {i}\n" for i in range(1, 2001))
    with open(ws / "sparse.log", "wb") as f:
        f.write(text.encode())
        f.truncate(2 << 30)  # then 2 GiB of zeros, one line with no end
    tracemalloc.start()
    try:
        first = await read_file.TOOL.handler(context(ws), {"path": "sparse.log"})
        last = await read_file.TOOL.handler(
            context(ws), {"path": "sparse.log", "offset": 2000, "limit": 5}
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert first.splitlines()[1] == "line 1" and first.splitlines()[-1] == "line 400"
    lines = last.splitlines()
    assert lines[1] == "line 2000" and lines[2].endswith(" [line cut]")
    assert lines[0] == "sparse.log: lines 2000-2001 (more follow; read on with offset=2002)"
    assert peak < 100 << 20, peak
    with pytest.raises(ToolError, match="^offset: line 2002 lies past a line of over 64 MiB"):
        await read_file.TOOL.handler(context(ws), {"path": "sparse.log", "offset": 2002})


async def test_read_file_refuses_binary_files_and_folders(ws):
    (ws / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02" * 10)
    with pytest.raises(ToolError, match="^path: blob.bin is a binary file"):
        await read_file.TOOL.handler(context(ws), {"path": "blob.bin"})
    with pytest.raises(ToolError, match="^path: docs is a folder; use list_dir"):
        await read_file.TOOL.handler(context(ws), {"path": "docs"})


async def test_a_near_miss_name_gets_a_did_you_mean_hint(ws):
    with pytest.raises(ToolError, match=r"^path: note.txt does not exist; did you mean notes.txt"):
        await read_file.TOOL.handler(context(ws), {"path": "note.txt"})
    with pytest.raises(ToolError, match=r"did you mean docs/readme.md"):
        await read_file.TOOL.handler(context(ws), {"path": "doc/readme.md"})


# -- list_dir -------------------------------------------------------------------------------


async def test_list_dir_shows_folders_first_then_files_with_sizes(ws):
    (ws / "broken").symlink_to(ws / "gone")
    text = await list_dir.TOOL.handler(context(ws), {})
    lines = text.splitlines()
    assert lines[0] == ".: 6 entries"
    assert lines[1:4] == ["docs/", "inner/", "out (a link out of the workspace)"]
    assert "broken (broken link)" in lines
    assert "notes.txt  (12 bytes)" in lines
    (ws / "empty").mkdir()
    assert await list_dir.TOOL.handler(context(ws), {"path": "empty"}) == "empty: 0 entries (empty)"
    file = await list_dir.TOOL.handler(context(ws), {"path": "notes.txt"})
    assert file == "notes.txt  (12 bytes; a file: read_file reads it)"
    with pytest.raises(ToolError, match="^path: doc does not exist; did you mean docs"):
        await list_dir.TOOL.handler(context(ws), {"path": "doc"})


# -- glob and grep --------------------------------------------------------------------------


@pytest.fixture
def tree(ws) -> Path:
    for path, text in {
        "a.py": "def alpha():\n    return 1\n",
        "pkg/b.py": "def beta(x):\n    return x\nDEF = 2\n",
        "pkg/sub/c.py": "class C:\n    def gamma(self):\n        pass\n",
        "pkg/readme.md": "def in markdown()\n",
        ".git/hooks/hook.py": "def hidden():\n",
        "__pycache__/cached.py": "def cached():\n",
    }.items():
        (ws / path).parent.mkdir(parents=True, exist_ok=True)
        (ws / path).write_text(text)
    return ws


async def test_glob_finds_files_in_every_folder_but_skips_git(tree):
    text = await glob.TOOL.handler(context(tree), {"pattern": "**/*.py"})
    assert text.splitlines() == ["3 files:", "a.py", "pkg/b.py", "pkg/sub/c.py"]
    assert await glob.TOOL.handler(context(tree), {"pattern": "*.py", "path": "pkg"}) == (
        "1 files:\npkg/b.py"
    )
    assert await glob.TOOL.handler(context(tree), {"pattern": "*.rs"}) == "no files match *.rs"


async def test_grep_matches_a_regex_in_the_included_files(tree):
    ctx = context(tree)
    text = await grep.TOOL.handler(ctx, {"pattern": r"def \w+\(", "include": "*.py"})
    assert text.splitlines() == [
        "a.py:1: def alpha():",
        "pkg/b.py:1: def beta(x):",
        "pkg/sub/c.py:2:     def gamma(self):",
    ]
    everywhere = await grep.TOOL.handler(ctx, {"pattern": "^def"})
    assert "pkg/readme.md:1: def in markdown()" in everywhere and "hidden" not in everywhere
    folded = await grep.TOOL.handler(
        ctx, {"pattern": "^def", "path": "pkg/b.py", "ignore_case": True}
    )
    assert folded.splitlines() == ["pkg/b.py:1: def beta(x):", "pkg/b.py:3: DEF = 2"]


async def test_grep_bad_regex_is_a_tool_error(tree):
    with pytest.raises(ToolError, match=r"^pattern: '\(unclosed' cannot be run \(missing \)"):
        await grep.TOOL.handler(context(tree), {"pattern": "(unclosed"})


async def test_a_catastrophic_pattern_neither_freezes_nor_stalls_the_process(ws):
    """`^(a+)+$` against a's and a `!` takes a backtracking engine 2^n steps, holding the
    GIL: every thread of the process (engine, server, TUI) would stop with it."""
    (ws / "evil.txt").write_text("a" * 40 + "!\n")
    ticks: list[float] = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.monotonic()
    try:
        text = await grep.TOOL.handler(context(ws), {"pattern": "^(a+)+$", "path": "evil.txt"})
    finally:
        stop.set()
        ticker.join()
    assert text == "no lines match '^(a+)+$'"
    assert time.monotonic() - start < 2
    ticks.append(time.monotonic())
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.5  # the other thread ran on
    with pytest.raises(ToolError, match=r"^pattern: '\(a\).*' cannot be run .*backreferences"):
        await grep.TOOL.handler(context(ws), {"pattern": r"(a)\1"})


async def test_long_paths_and_absolute_includes_are_errors_naming_the_argument(ws):
    ctx = context(ws)
    for tool, args, field in [
        (read_file, {"path": "x" * 300}, "path"),
        (write_file, {"path": "a/" * 2100 + "f", "content": "x"}, "path"),
        (grep, {"pattern": "x", "path": "y" * 256}, "path"),
        (list_dir, {"path": "z" * 1000}, "path"),
        (grep, {"pattern": "root", "include": "/etc/*"}, "include"),
        (grep, {"pattern": "root", "include": "../*"}, "include"),
    ]:
        with pytest.raises(ToolError, match=f"^{field}: "):
            await tool.TOOL.handler(ctx, args)


async def test_grep_stops_at_its_match_cap(ws):
    (ws / "many.txt").write_text("match\n" * 500)
    text = await grep.TOOL.handler(context(ws), {"pattern": "match"})
    lines = text.splitlines()
    assert len(lines) == grep.MAX_MATCHES + 1
    assert lines[-1] == f"[stopped at {grep.MAX_MATCHES} matches]"


# -- write_file and edit_file ---------------------------------------------------------------


async def test_write_file_asks_with_a_diff_and_a_refusal_leaves_the_file(ws):
    (ws / "a.txt").write_text("keep\nold line\n")
    ask = Recorder(False)
    with pytest.raises(ToolError, match="^the user declined to edit a.txt"):
        await write_file.TOOL.handler(
            context(ws, Approvals(ask=ask)), {"path": "a.txt", "content": "keep\nnew line\n"}
        )
    assert (ws / "a.txt").read_text() == "keep\nold line\n"
    [request] = ask.requests
    assert (request.kind, request.tool, request.summary) == ("edit", "write_file", "edit a.txt")
    assert request.session_title == "tools"
    assert request.detail.startswith("--- a/a.txt\n+++ b/a.txt\n@@")
    assert "\n-old line\n+new line\n" in request.detail and " keep\n" in request.detail


async def test_write_file_creates_folders_once_approved(ws):
    ask = Recorder(True)
    result = await write_file.TOOL.handler(
        context(ws, Approvals(ask=ask)), {"path": "new/deep/b.txt", "content": "one\ntwo\n"}
    )
    assert result == "new/deep/b.txt: created (+2 -0 lines)"
    assert (ws / "new" / "deep" / "b.txt").read_text() == "one\ntwo\n"
    assert ask.requests[0].summary == "create new/deep/b.txt"
    assert "+++ b/new/deep/b.txt" in ask.requests[0].detail


async def test_allowed_edits_do_not_ask_and_nothing_allowed_is_refused(ws):
    (ws / "a.txt").write_text("old\n")
    allowed = context(ws, Approvals(allow_edits=True, ask=never_ask))
    result = await write_file.TOOL.handler(allowed, {"path": "a.txt", "content": "new\n"})
    assert result == "a.txt: edited (+1 -1 lines)"
    unchanged = await write_file.TOOL.handler(allowed, {"path": "a.txt", "content": "new\n"})
    assert "unchanged" in unchanged
    with pytest.raises(ToolError, match="declined"):  # no ask, nothing allowed: refused
        await write_file.TOOL.handler(context(ws), {"path": "a.txt", "content": "x\n"})
    assert (ws / "a.txt").read_text() == "new\n"


async def test_edit_file_replaces_one_exact_string_after_approval(ws):
    (ws / "code.py").write_text("x = 1\ny = 2\n")
    ask = Recorder(True)
    ctx = context(ws, Approvals(ask=ask))
    result = await edit_file.TOOL.handler(
        ctx, {"path": "code.py", "old_string": "y = 2", "new_string": "y = 3"}
    )
    assert result == "code.py: edited (+1 -1 lines)"
    assert (ws / "code.py").read_text() == "x = 1\ny = 3\n"
    assert "-y = 2\n+y = 3\n" in ask.requests[0].detail
    assert ask.requests[0].tool == "edit_file"


async def test_an_edit_leaves_bytes_that_are_not_utf8_as_they_were(ws):
    (ws / "latin1.txt").write_bytes(b"caf\xe9 au lait\nline two\n\xff\xfe end\n")
    recorder = Recorder(True)
    ctx = context(ws, Approvals(ask=recorder))
    done = await edit_file.TOOL.handler(
        ctx, {"path": "latin1.txt", "old_string": "line two", "new_string": "line 2"}
    )
    assert done == "latin1.txt: edited (+1 -1 lines)"
    assert (ws / "latin1.txt").read_bytes() == b"caf\xe9 au lait\nline 2\n\xff\xfe end\n"
    diff = recorder.requests[0].detail
    assert "-line two\n+line 2\n" in diff and "\udce9" not in diff
    with pytest.raises(ToolError, match="^new_string: holds a lone surrogate"):
        await edit_file.TOOL.handler(
            ctx, {"path": "latin1.txt", "old_string": "line 2", "new_string": "\ud800"}
        )


async def test_edit_file_declined_leaves_the_file(ws):
    (ws / "code.py").write_text("x = 1\n")
    with pytest.raises(ToolError, match="declined"):
        await edit_file.TOOL.handler(
            context(ws, Approvals(ask=Recorder(False))),
            {"path": "code.py", "old_string": "1", "new_string": "2"},
        )
    assert (ws / "code.py").read_text() == "x = 1\n"


async def test_edit_file_old_string_missing_ambiguous_or_replace_all(ws):
    (ws / "code.py").write_text("a = 1\nb = 1\n")
    ctx = context(ws, Approvals(allow_edits=True))

    async def edit(**args):
        return await edit_file.TOOL.handler(ctx, {"path": "code.py", **args})

    with pytest.raises(ToolError, match="^old_string: not found in code.py"):
        await edit(old_string="c = 1", new_string="c = 2")
    with pytest.raises(ToolError, match="^old_string: found 2 times in code.py"):
        await edit(old_string="= 1", new_string="= 2")
    with pytest.raises(ToolError, match="^new_string: it is the same"):
        await edit(old_string="a", new_string="a")
    assert (ws / "code.py").read_text() == "a = 1\nb = 1\n"
    assert await edit(old_string="= 1", new_string="= 2", replace_all=True) == (
        "code.py: edited (+2 -2 lines)"
    )
    assert (ws / "code.py").read_text() == "a = 2\nb = 2\n"
    with pytest.raises(ToolError, match="^path: nope.py does not exist; use write_file"):
        await edit_file.TOOL.handler(ctx, {"path": "nope.py", "old_string": "a", "new_string": "b"})


# -- run_command ----------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def gone_soon(pid: int, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def pid_in(path: Path, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path.name} was not written"
        await asyncio.sleep(0.02)
    return int(path.read_text())


async def run(ws: Path, command: str, timeout: int | None = None) -> str:
    args = {"command": command} | ({"timeout": timeout} if timeout else {})
    return await run_command.TOOL.handler(context(ws, Approvals(allow_commands=True)), args)


async def test_run_command_asks_and_a_refusal_runs_nothing(ws):
    ask = Recorder(False)
    with pytest.raises(ToolError, match="^the user declined to run: touch marker"):
        await run_command.TOOL.handler(context(ws, Approvals(ask=ask)), {"command": "touch marker"})
    await asyncio.sleep(0.2)
    assert not (ws / "marker").exists()
    [request] = ask.requests
    assert (request.kind, request.tool) == ("command", "run_command")
    assert (request.summary, request.detail) == ("run: touch marker", "touch marker")
    ask.answer = True
    await run_command.TOOL.handler(context(ws, Approvals(ask=ask)), {"command": "touch marker"})
    assert (ws / "marker").exists()


async def test_run_command_captures_output_and_exit_code_in_the_workspace(ws):
    result = await run(ws, "echo to-out; echo to-err >&2; pwd; exit 3")
    assert result.splitlines() == [
        "$ echo to-out; echo to-err >&2; pwd; exit 3",
        "exit code 3",
        "to-out",
        "to-err",
        str(ws),
    ]


async def test_a_timeout_kills_the_command_and_its_background_children(ws):
    result = await run(ws, "echo $$ > sh.pid; sleep 30 & echo $! > bg.pid; sleep 30", timeout=1)
    assert result.splitlines()[1] == "timed out after 1 s"
    assert gone_soon(int((ws / "sh.pid").read_text()))
    assert gone_soon(int((ws / "bg.pid").read_text()))


async def test_a_finished_command_returns_at_once_and_its_background_child_is_killed(ws):
    result = await run(ws, "sleep 30 & echo $! > bg.pid; echo started", timeout=20)
    # "exit code 0", not "timed out": the child holding the output pipe did not hold the call
    assert result.splitlines()[1:] == ["exit code 0", "started"]
    assert gone_soon(int((ws / "bg.pid").read_text()))


async def test_a_child_that_leaves_the_group_does_not_hang_the_call(ws):
    # The shell waits until the child has left its group (written its pid from its new
    # session): exiting earlier, the group kill could still reach it.
    command = (
        "setsid sh -c 'echo $$ > bg.pid; exec sleep 30' & "
        "while [ ! -s bg.pid ]; do sleep 0.01; done; echo started"
    )
    try:
        result = await run(ws, command, timeout=20)
        assert result.splitlines()[1].startswith("exit code 0; a process it started outside")
        assert result.splitlines()[2] == "started"
    finally:
        with contextlib.suppress(ProcessLookupError):  # outside the group: ours to end
            os.kill(await pid_in(ws / "bg.pid"), signal.SIGKILL)


async def test_megabytes_of_output_are_capped_with_a_note(ws):
    result = await run(ws, "yes | head -c 3000000")
    assert len(result) < 13_000
    assert result.splitlines()[1] == "exit code 0"
    kept = run_command.MAX_OUTPUT_BYTES
    assert result.endswith(f"[... {3_000_000 - kept} more bytes of output not kept]")


async def test_cancelling_the_call_kills_the_process_group(ws):
    task = asyncio.create_task(run(ws, "echo $$ > sh.pid; sleep 30 & echo $! > bg.pid; wait"))
    shell, background = await pid_in(ws / "sh.pid"), await pid_in(ws / "bg.pid")
    assert alive(shell) and alive(background)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone_soon(shell) and gone_soon(background)


async def test_writes_inside_git_are_refused_even_when_edits_are_allowed(ws):
    ctx = context(ws, Approvals(allow_edits=True))
    with pytest.raises(ToolError, match=r"^path: \.git/hooks/pre-commit is inside \.git"):
        await write_file.TOOL.handler(ctx, {"path": ".git/hooks/pre-commit", "content": "x"})
    assert not (ws / ".git" / "hooks" / "pre-commit").exists()
    for spelled in (".GIT/config", "sub/.Git/hooks/post-checkout"):
        with pytest.raises(ToolError, match="is inside .git"):
            await write_file.TOOL.handler(ctx, {"path": spelled, "content": "x"})
        assert not (ws / spelled).exists()


async def test_an_edit_that_waited_while_another_landed_does_not_undo_it(ws):
    (ws / "f.txt").write_text("one\ntwo\n")

    async def meanwhile(request: ApprovalRequest) -> bool:
        (ws / "f.txt").write_text("one\nTWO (an edit approved first)\n")
        return True

    ctx = context(ws, Approvals(ask=meanwhile))
    with pytest.raises(ToolError, match="changed while this change waited for approval"):
        await edit_file.TOOL.handler(
            ctx, {"path": "f.txt", "old_string": "one", "new_string": "ONE"}
        )
    assert (ws / "f.txt").read_text() == "one\nTWO (an edit approved first)\n"


async def test_a_fifo_is_not_read(ws):
    os.mkfifo(ws / "pipe")
    with pytest.raises(ToolError, match="not a regular file"):
        await read_file.TOOL.handler(context(ws), {"path": "pipe"})


async def test_list_dir_tells_nothing_of_a_link_out(ws, tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"x" * 1234)
    (ws / "leak").symlink_to(tmp_path / "secret.bin")
    listing = await list_dir.TOOL.handler(context(ws), {"path": "."})
    assert "leak (a link out of the workspace)" in listing and "1234" not in listing


def test_streamed_calls_without_an_index_stay_apart():
    from lucedesk.agent.backend import call_of

    calls: dict = {}
    pieces = [
        {"id": "a", "function": {"name": "read_file", "arguments": '{"path":'}},
        {"function": {"arguments": ' "x"}'}},
        {"id": "b", "function": {"name": "glob", "arguments": '{"pattern": "*"}'}},
    ]
    for piece in pieces:
        call = call_of(calls, piece)
        call["id"] = piece.get("id") or call["id"]
        call["name"] += piece["function"].get("name") or ""
        call["arguments"] += piece["function"]["arguments"]
    assert [(c["id"], c["name"], c["arguments"]) for c in calls.values()] == [
        ("a", "read_file", '{"path": "x"}'),
        ("b", "glob", '{"pattern": "*"}'),
    ]


# -- big files, races and what the file system says ------------------------------------------


@pytest.mark.parametrize("kind", ["sparse 2 GiB", "100 MB on one line", "binary"])
async def test_edits_refuse_a_big_or_binary_file_before_reading_it(ws, kind):
    target = ws / "big.txt"
    with open(target, "wb") as f:
        if kind == "sparse 2 GiB":
            f.truncate(2 << 30)
        elif kind == "100 MB on one line":
            f.write(b"x" * (100 << 20))
        else:
            f.write(b"\x00\x01" + b"x" * (3 << 20))
    ctx = context(ws, Approvals(allow_edits=True))
    tracemalloc.start()
    try:
        with pytest.raises(ToolError, match="big.txt (is .* bytes; edit_file|is a binary)"):
            await edit_file.TOOL.handler(
                ctx, {"path": "big.txt", "old_string": "x", "new_string": "y"}
            )
        with pytest.raises(ToolError, match="big.txt (is .* bytes; edit_file|is a binary)"):
            await write_file.TOOL.handler(ctx, {"path": "big.txt", "content": "small"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20  # nothing read whole (a 2 GiB read peaked at 2.1 GB)


def swap_after_check(monkeypatch, ws: Path, folder: str, outside: Path) -> None:
    """The race a symlink swap makes, at its worst moment: `folder` is checked inside the
    workspace, then replaced by a link to `outside` before it is read."""
    resolve = Workspace.resolve

    def resolve_then_swap(self, path, field="path"):
        real = resolve(self, path, field)
        victim = ws / folder
        if victim.is_dir() and not victim.is_symlink():
            victim.rename(ws / (folder + ".old"))
            victim.symlink_to(outside, target_is_directory=True)
        return real

    monkeypatch.setattr(Workspace, "resolve", resolve_then_swap)


@pytest.mark.parametrize("tool", ["list_dir", "glob"])
async def test_a_folder_swapped_for_a_link_is_never_listed_through_it(ws, tool, monkeypatch):
    swap_after_check(monkeypatch, ws, "docs", ws.parent / "outside")
    args = {"path": "docs"} if tool == "list_dir" else {"pattern": "*", "path": "docs"}
    try:
        text = await TOOLS[tool].handler(context(ws), args)
    except ToolError as exc:
        text = str(exc)
    assert "secret" not in text, text


async def test_a_file_that_vanishes_mid_call_is_a_tool_error_naming_it(ws, monkeypatch):
    from lucedesk.agent.tool_runner import call_tool
    from lucedesk.chat import ToolCall

    session = SimpleNamespace(
        workspace=Workspace(ws),
        runtime=SimpleNamespace(approvals=Approvals()),
        title="tools",
        tools=lambda: list(TOOLS.values()),
        run_child=None,
    )
    is_dir = Path.is_dir

    def gone_after_the_check(self):  # the file goes between list_dir's checks and its stat
        if self.name == "notes.txt":
            self.unlink(missing_ok=True)
        return is_dir(self)

    monkeypatch.setattr(Path, "is_dir", gone_after_the_check)
    call = ToolCall("c1", "list_dir", '{"path": "notes.txt"}')
    with pytest.raises(ToolError, match=r"^path: notes.txt: No such file or directory"):
        await call_tool(session, call, TOOLS["list_dir"])


async def test_a_long_file_name_can_be_written(ws):
    name = "n" * 250 + ".txt"  # a temporary name beside it must stay within 255 bytes
    ctx = context(ws, Approvals(allow_edits=True))
    result = await write_file.TOOL.handler(ctx, {"path": name, "content": "hello\n"})
    assert "created" in result and (ws / name).read_text() == "hello\n"
