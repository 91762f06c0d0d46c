"""Which process owns a running session: a lock file each open store holds, which the OS
drops when the process ends, however it ends."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; every other owner counts as gone
    fcntl = None


class Owner:
    """This store's claim on what it runs: a lock file held while it is open. The OS drops
    the lock when the process ends (kill -9 included), so another process tells a live
    owner from a gone one, whatever pids are reused."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(exist_ok=True)
        self.folder = folder
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        # Locked before it takes its name: no other process sees it unlocked.
        fresh = folder / f".{self.token}.new"
        self._fd: int | None = os.open(fresh, os.O_RDWR | os.O_CREAT, 0o600)
        if fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(fresh, self._path(self.token))
        for stale in folder.glob("*.lock"):  # files of processes that ended without closing
            self.alive(stale.stem)

    def _path(self, token: str) -> Path:
        return self.folder / f"{token}.lock"

    def alive(self, token: str) -> bool:
        """Whether the owner `token` still holds its lock (an empty token: an older
        lucedesk's row, whose owner is gone)."""
        if token == self.token:
            return self._fd is not None
        if not token or fcntl is None or "/" in token:
            return False
        try:
            fd = os.open(self._path(token), os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        self._path(token).unlink(missing_ok=True)
        return False

    def release(self) -> None:
        if self._fd is not None:
            self._path(self.token).unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
