"""Sessions and their messages in SQLite, written as the conversation happens: a user
message is saved when sent and a reply when it ends, so a crash loses at most the reply in
flight."""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    created REAL NOT NULL
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
    messages: list[dict] = field(default_factory=list)  # {"role", "content"}

    def chat_messages(self) -> list[dict]:
        """What the model sees: the system prompt, then the conversation."""
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages]


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)

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

    def add_message(self, session: Session, role: str, content: str) -> None:
        session.messages.append({"role": role, "content": content})
        with self._lock:
            self._db.execute(
                "INSERT INTO messages (session_id, role, content, created) VALUES (?, ?, ?, ?)",
                (session.id, role, content, time.time()),
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
                    {"role": role, "content": content}
                    for role, content in self._db.execute(
                        "SELECT role, content FROM messages WHERE session_id = ? ORDER BY id",
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
