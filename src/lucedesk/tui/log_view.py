"""What the TUI's process logs, kept for the log view (F9): one line per HTTP request (the
access log, server/access.py) and lucedesk's warnings and errors, the last 1,000. Records
come from any thread (the HTTP server's, the engine's); the view is told on the event loop."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

KEPT = 1000


class KeptLog(logging.Handler):
    """Formats each record into `lines`; `shown`, while the view is open, gets it too."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: deque[str] = deque(maxlen=KEPT)
        self.shown: Callable[[str], None] | None = None
        self.addFilter(lambda r: r.levelno >= logging.WARNING or r.name == "lucedesk.access")

    def emit(self, record: logging.LogRecord) -> None:
        when = time.strftime("%H:%M:%S", time.localtime(record.created))
        level = "" if record.levelno < logging.WARNING else f"{record.levelname} "
        line = f"{when} {level}{record.getMessage()}"
        self.lines.append(line)
        shown = self.shown
        if shown is not None:
            shown(line)

    def install(self) -> None:
        """Kept here, and not written to the terminal the TUI draws on."""
        root = logging.getLogger("lucedesk")
        root.addHandler(self)
        root.propagate = False
        logging.getLogger("lucedesk.access").setLevel(logging.INFO)

    def remove(self) -> None:
        root = logging.getLogger("lucedesk")
        root.removeHandler(self)
        root.propagate = True
