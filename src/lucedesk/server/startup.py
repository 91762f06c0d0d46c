"""What a start is doing and since when: each stage said when it begins, said again with
its elapsed time every few seconds while it lasts (the first start builds the C++ kernels,
minutes on a loaded machine), and what /health answers meanwhile ("starting")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Startup:
    def __init__(self, say: Callable[[str], None], every: float = 10.0) -> None:
        self.say = say
        self.every = every
        self.text = "starting"
        self.since = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._tick, name="lucedesk-startup", daemon=True).start()

    def stage(self, text: str) -> None:
        with self._lock:
            self.text, self.since = text, time.monotonic()
        self.say(text)

    def describe(self) -> str:
        with self._lock:
            return f"{self.text} ({time.monotonic() - self.since:.0f} s)"

    def done(self) -> None:
        self._done.set()

    def _tick(self) -> None:
        while not self._done.wait(self.every):
            with self._lock:
                text, since = self.text, self.since
            self.say(f"{text}: {time.monotonic() - since:.0f} s so far")
