"""The folder an agent session works in. Every path a tool touches goes through
`Workspace.resolve`, which follows symlinks and refuses anything that lands outside; files
are then opened from a descriptor of the root one folder at a time, following no link
(`open_parent`), so a folder swapped for a link after the check (while a write waits for its
approval, or by a racing process) is an error, never a way out."""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from lucedesk.agent.tool_error import ToolError

# What file systems hold (Linux's PATH_MAX and NAME_MAX): longer is an error naming the field.
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
# Folders no search walks into.
SKIPPED = frozenset({".git", "__pycache__", "node_modules", ".venv"})
# The largest file an edit reads whole: a bigger one (a log, a data dump, a sparse image) is
# refused before a byte of it is read.
MAX_EDIT_BYTES = 4 << 20
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY


class Workspace:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise ValueError(f"workspace {root}: not a folder")

    def resolve(self, path: str, field: str = "path") -> Path:
        """`path` (relative to the root, or absolute) with symlinks resolved; a ToolError naming
        `field` if it leaves the workspace."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError(f"{field}: give a path inside the workspace")
        if "\x00" in path:
            raise ToolError(f"{field}: a path cannot hold a NUL byte")
        if len(path.encode(errors="replace")) > MAX_PATH_BYTES:
            raise ToolError(f"{field}: the path is longer than {MAX_PATH_BYTES} bytes")
        if any(len(part.encode(errors="replace")) > MAX_NAME_BYTES for part in Path(path).parts):
            raise ToolError(f"{field}: a name in the path is longer than {MAX_NAME_BYTES} bytes")
        try:
            # follows every symlink that exists along the way
            real = (self.root / Path(path).expanduser()).resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop (Python < 3.13), ~nosuchuser
            raise ToolError(f"{field}: {path}: {exc}") from None
        if not real.is_relative_to(self.root):
            raise ToolError(f"{field}: {path} is outside the workspace ({self.root})")
        return real

    def open_parent(self, real: Path, field: str = "path", create: bool = False):
        """(a descriptor of the folder holding `real`, its name there): `real` resolved
        inside the root, opened from the root folder by folder with O_NOFOLLOW. `create`
        makes missing folders; without it a missing folder is FileNotFoundError. The caller
        closes the descriptor."""
        parts = real.relative_to(self.root).parts
        if not parts:
            raise ToolError(f"{field}: the workspace itself is a folder")
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts[:-1]:
                if create:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = inner
        except FileNotFoundError:
            os.close(fd)
            if create:  # made a moment ago, gone now: someone else is at work in there
                raise ToolError(f"{field}: {self.show(real)} changed while in use") from None
            raise
        except OSError as exc:
            os.close(fd)
            raise ToolError(
                f"{field}: {self.show(real)} changed while in use ({exc.strerror}): a folder "
                "on its way is no longer the folder it was"
            ) from None
        return fd, parts[-1]

    def open_dir(self, real: Path, field: str = "path") -> int:
        """A descriptor of the folder `real` (resolved inside the root), opened through
        `open_parent`, its own name not followed either: a folder swapped for a link since
        `resolve` checked it is an error, never a listing of what the link points at."""
        if real == self.root:
            return os.open(self.root, DIRECTORY)
        dir_fd, name = self.open_parent(real, field)
        try:
            return os.open(name, DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError as exc:
            raise ToolError(f"{field}: {self.show(real)}: {exc.strerror}") from None
        finally:
            os.close(dir_fd)

    def walk_files(self, base: Path, limit: int = 100_000) -> Iterator[str]:
        """The files under the folder `base` (resolved inside the root), as paths relative
        to it: folders entered through their descriptors, never through a link, those of
        SKIPPED never; a link to a file inside the workspace counts as a file."""
        stack = [(self.open_dir(base), "")]
        seen = 0
        try:
            while stack:
                fd, prefix = stack.pop()
                try:
                    with os.scandir(fd) as entries:
                        found = sorted(entries, key=lambda e: e.name)
                    for entry in found:
                        seen += 1
                        if seen > limit:
                            return
                        name = prefix + entry.name
                        if entry.is_dir(follow_symlinks=False):
                            if entry.name in SKIPPED:
                                continue
                            try:
                                inner = os.open(entry.name, DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                            except OSError:  # gone, or swapped for a link since it was listed
                                continue
                            stack.append((inner, name + "/"))
                        elif entry.is_symlink():
                            target = (base / name).resolve()
                            if target.is_relative_to(self.root) and target.is_file():
                                yield name
                        elif entry.is_file(follow_symlinks=False):
                            yield name
                finally:
                    os.close(fd)
        finally:
            for fd, _ in stack:
                os.close(fd)

    def open_read(self, real: Path, field: str = "path") -> BinaryIO | None:
        """The regular file `real` opened for reading through `open_parent` (never through
        a link), None when it does not exist."""
        try:
            dir_fd, name = self.open_parent(real, field)
        except FileNotFoundError:
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ToolError(f"{field}: {self.show(real)}: {exc.strerror}") from None
        finally:
            os.close(dir_fd)
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device: would block
            f.close()
            raise ToolError(f"{field}: {self.show(real)} is not a regular file")
        return f

    def read_for_write(self, real: Path, field: str = "path") -> bytes | None:
        """The bytes of `real` before a write (None: it does not exist yet); a file with
        other hard links (a name that may lie outside), one over MAX_EDIT_BYTES and one
        that is binary are refused before it is read whole."""
        f = self.open_read(real, field)
        if f is None:
            return None
        with f:
            info = os.fstat(f.fileno())
            if info.st_nlink > 1:
                raise ToolError(
                    f"{field}: {self.show(real)} has other hard links (names that may lie "
                    "outside the workspace); lucedesk does not write to it"
                )
            if info.st_size > MAX_EDIT_BYTES:
                raise ToolError(
                    f"{field}: {self.show(real)} is {info.st_size:,} bytes; edit_file and "
                    f"write_file change files of at most {MAX_EDIT_BYTES:,} (run_command can "
                    "change bigger ones)"
                )
            head = f.read(8192)
            if b"\x00" in head:
                raise ToolError(f"{field}: {self.show(real)} is a binary file")
            return head + f.read(MAX_EDIT_BYTES + 1 - len(head))

    def missing(self, path: str, field: str = "path") -> ToolError:
        """The error for a path that does not exist, naming the closest paths that do."""
        names = []
        for i, p in enumerate(self.root.rglob("*")):
            if i >= 5000:
                break
            if not SKIPPED.intersection(p.relative_to(self.root).parts):
                names.append(p.relative_to(self.root).as_posix())
        close = difflib.get_close_matches(path.strip("/").removeprefix("./"), names, 3, 0.5)
        if not close:
            close = difflib.get_close_matches(Path(path).name, names, 3, 0.5)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return ToolError(f"{field}: {path} does not exist{hint}")

    def show(self, path: Path) -> str:
        """A path as the model should write it back: relative to the root."""
        relative = path.relative_to(self.root).as_posix()
        return relative or "."
