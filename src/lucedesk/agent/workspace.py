"""The folder an agent session works in. Every path a tool touches goes through
`Workspace.resolve`, which follows symlinks and refuses anything that lands outside."""

from __future__ import annotations

import difflib
from pathlib import Path

from lucedesk.agent.tools.base import ToolError

# What file systems hold (Linux's PATH_MAX and NAME_MAX): longer is an error naming the field.
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
# Folders no search walks into.
SKIPPED = frozenset({".git", "__pycache__", "node_modules", ".venv"})


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
