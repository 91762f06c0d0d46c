"""Sessions and their messages in SQLite (WAL), written as the conversation happens: a user
message when sent, a reply when it starts and again as it grows (at most once a second) and
when it ends. A crash (even `kill -9`) loses at most the last second of a reply; the store
opened again marks a reply that was still streaming as interrupted."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    temperature REAL NOT NULL DEFAULT 0.7,
    max_tokens INTEGER NOT NULL DEFAULT 512,
    kind TEXT NOT NULL DEFAULT 'chat',
    parent_id INTEGER,
    created REAL NOT NULL,
    backend_url TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL,
    status TEXT NOT NULL DEFAULT 'done'  -- done | streaming | interrupted
);
"""


@dataclass
class Session:
    id: int
    title: str
    system_prompt: str = ""
    temperature: float = 0.7
    max_tokens: int = 512
    kind: str = "chat"  # chat | subagent
    parent_id: int | None = None
    backend_url: str = ""  # "" = the in-process engine, else an OpenAI-compatible server
    # {"role", "content", "status"} (+ "id", the row, while a reply streams)
    messages: list[dict] = field(default_factory=list)

    def chat_messages(self) -> list[dict]:
        """What the model sees: the system prompt, then the conversation (without a reply
        that is still being written)."""
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return head + [
            {"role": m["role"], "content": m["content"]}
            for m in self.messages
            if m.get("status") != "streaming"
        ]


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        # SQLite answers with the mode it could set (a filesystem without shared memory
        # keeps "delete"); commits are durable either way, WAL just keeps readers unblocked.
        self.journal_mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower()
        if self.journal_mode != "wal":
            log.warning("%s: WAL is not available here (journal mode %s)", path, self.journal_mode)
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(messages)")}
        if "status" not in columns:  # a store from before replies were saved as they grow
            self._db.execute("ALTER TABLE messages ADD COLUMN status TEXT NOT NULL DEFAULT 'done'")
        # Replies still streaming belong to a process that is gone.
        self._db.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming'")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Everything written inside lands together or not at all (a fan-out's parent and
        children)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create_session(
        self,
        title: str,
        kind: str = "chat",
        parent_id: int | None = None,
        system_prompt: str = "",
        temperature: float = 0.7,
        max_tokens: int = 512,
    ) -> Session:
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO sessions (title, system_prompt, temperature, max_tokens, kind, "
                "parent_id, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (title, system_prompt, temperature, max_tokens, kind, parent_id, time.time()),
            )
        return Session(
            cur.lastrowid, title, system_prompt, temperature, max_tokens, kind, parent_id
        )

    def update_session(self, session: Session) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE sessions SET title=?, system_prompt=?, temperature=?, max_tokens=?, "
                "backend_url=? WHERE id=?",
                (
                    session.title,
                    session.system_prompt,
                    session.temperature,
                    session.max_tokens,
                    session.backend_url,
                    session.id,
                ),
            )

    def add_message(self, session: Session, role: str, content: str, status: str = "done") -> dict:
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO messages (session_id, role, content, created, status) "
                "VALUES (?, ?, ?, ?, ?)",
                (session.id, role, content, time.time(), status),
            )
        message = {"role": role, "content": content, "status": status, "id": cur.lastrowid}
        session.messages.append(message)
        return message

    def begin_reply(self, session: Session) -> dict:
        """The assistant's reply, saved (empty, streaming) before its first token."""
        return self.add_message(session, "assistant", "", status="streaming")

    def update_reply(self, reply: dict, content: str, status: str = "streaming") -> None:
        """Saves the reply's text so far; `status` "done" when it has ended."""
        reply["content"], reply["status"] = content, status
        with self._lock:
            self._db.execute(
                "UPDATE messages SET content = ?, status = ? WHERE id = ?",
                (content, status, reply["id"]),
            )

    def drop_last_message(self, session: Session) -> None:
        """Forget the newest message (regenerate replaces the last reply)."""
        if session.messages:
            session.messages.pop()
        with self._lock:
            self._db.execute(
                "DELETE FROM messages WHERE id = (SELECT MAX(id) FROM messages "
                "WHERE session_id = ?)",
                (session.id,),
            )

    def delete_session(self, session_id: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def sessions(self, kind: str = "chat") -> list[Session]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, title, system_prompt, temperature, max_tokens, kind, parent_id, "
                "backend_url FROM sessions WHERE kind = ? ORDER BY id",
                (kind,),
            ).fetchall()
            out = [Session(*row) for row in rows]
            for s in out:
                s.messages = [
                    {"role": role, "content": content, "status": status, "id": row_id}
                    for row_id, role, content, status in self._db.execute(
                        "SELECT id, role, content, status FROM messages WHERE session_id = ? "
                        "ORDER BY id",
                        (s.id,),
                    )
                ]
        return out


def export_markdown(session: Session) -> str:
    lines = [f"# {session.title}", ""]
    if session.system_prompt:
        lines += [f"> system: {session.system_prompt}", ""]
    for m in session.messages:
        lines += [f"## {m['role']}", "", m["content"], ""]
    return "\n".join(lines)
