"""Sessions and their messages in SQLite (WAL), written as the conversation happens: a user
message when sent, a reply when it starts and again as it grows (at most once a second) and
when it ends, a tool call when it starts and its result when it ends. A crash (even
`kill -9`) loses at most the last second of a reply; the store opened again marks a reply or
tool call that was still running as interrupted, and a session that was running too, when
the process that ran them is gone (a TUI and a headless agent share one store: neither
marks the other's work).

Chat panes, agent sessions and their children (subagents: `kind` 'subagent' with a
`parent_id`) are all sessions here; their messages are StoredMessages (message.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from lucedesk.owner import Owner
from lucedesk.store.message import StoredMessage
from lucedesk.store.schema import create_tables
from lucedesk.store.session import EDITABLE_COLUMNS, SESSION_COLUMNS, Session, last_user_id

__all__ = ["Session", "Store", "StoredMessage", "data_dir", "last_user_id"]

log = logging.getLogger(__name__)


def data_dir() -> Path:
    """Where sessions are kept (LUCEDESK_DATA_DIR, else the platform's data folder)."""
    import platformdirs

    return Path(os.environ.get("LUCEDESK_DATA_DIR") or platformdirs.user_data_dir("lucedesk"))


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
        create_tables(self._db)
        self.owner = Owner(path.parent / f"{path.name}.owners")
        self.interrupt_orphans()

    def interrupt_orphans(self) -> None:
        """Replies, tool calls and sessions still running whose process is gone are
        interrupted; another live process's are left running."""
        with self._lock:
            owners = self._db.execute(
                "SELECT owner FROM sessions WHERE status = 'running' UNION "
                "SELECT owner FROM messages WHERE status = 'streaming'"
            ).fetchall()
            for (owner,) in owners:
                if self.owner.alive(owner):
                    continue
                self._db.execute(
                    "UPDATE messages SET status = 'interrupted' "
                    "WHERE status = 'streaming' AND owner = ?",
                    (owner,),
                )
                self._db.execute(
                    "UPDATE sessions SET status = 'interrupted' "
                    "WHERE status = 'running' AND owner = ?",
                    (owner,),
                )

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
            self.owner.release()

    def create_session(
        self,
        title: str,
        kind: str = "chat",
        parent_id: int | None = None,
        system_prompt: str = "",
        temperature: float = 0.7,
        max_tokens: int = 512,
        agent_type: str = "chat",
        workspace: str = "",
        backend_url: str = "",
    ) -> Session:
        session = Session(
            0,  # the row's own, once inserted
            title,
            system_prompt=system_prompt,
            temperature=temperature,
            max_tokens=max_tokens,
            kind=kind,
            parent_id=parent_id,
            backend_url=backend_url,
            agent_type=agent_type,
            workspace=workspace,
        )
        columns = [c for c in SESSION_COLUMNS if c != "id"]
        with self._lock:
            cur = self._db.execute(
                f"INSERT INTO sessions ({', '.join(columns)}, created) "
                f"VALUES ({', '.join('?' * len(columns))}, ?)",
                (*(getattr(session, c) for c in columns), time.time()),
            )
        session.id = cur.lastrowid
        return session

    def update_session(self, session: Session) -> None:
        with self._lock:
            self._db.execute(
                f"UPDATE sessions SET {', '.join(f'{c}=?' for c in EDITABLE_COLUMNS)} WHERE id=?",
                (*(getattr(session, c) for c in EDITABLE_COLUMNS), session.id),
            )

    def set_status(self, session: Session, status: str) -> None:
        session.status = status
        with self._lock:
            self._db.execute(
                "UPDATE sessions SET status=?, owner=? WHERE id=?",
                (status, self.owner.token, session.id),
            )

    def add_message(self, session: Session, message: StoredMessage) -> StoredMessage:
        """Saves `message` as the session's newest (its id set) and returns it."""
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO messages (session_id, role, content, created, status, meta, owner) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    session.id,
                    message.role,
                    message.content,
                    time.time(),
                    message.status,
                    json.dumps(message.meta()),
                    self.owner.token,
                ),
            )
        message.id = cur.lastrowid or 0
        session.messages.append(message)
        return message

    def begin_reply(self, session: Session, split: int = 0) -> StoredMessage:
        """The assistant's reply, saved (empty, streaming) before its first token."""
        return self.add_message(session, StoredMessage("assistant", "", "streaming", split=split))

    def update_reply(self, reply: StoredMessage, content: str, status: str = "streaming") -> None:
        """Saves the reply's (or tool call's) text so far, and its other fields as they
        stand; `status` "done" when it has ended."""
        reply.content, reply.status = content, status
        with self._lock:
            self._db.execute(
                "UPDATE messages SET content = ?, status = ?, meta = ? WHERE id = ?",
                (content, status, json.dumps(reply.meta()), reply.id),
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

    def set_aside_reply(self, session: Session) -> None:
        """Ctrl+R: the messages after the last user message (a reply, its tool calls) leave
        the conversation but stay stored, for undo_set_aside to bring back. Each time is
        numbered (status `aside<n>:<status>`), so undo goes back one at a time."""
        after = last_user_id(session)
        while session.messages and session.messages[-1].id > after:
            session.messages.pop()
        with self._lock, self.transaction():
            number = 1 + max((n for n, _ in self._set_aside(session.id, after).values()), default=0)
            self._db.execute(
                "UPDATE messages SET status = ? || status "
                "WHERE session_id = ? AND id > ? AND status NOT LIKE 'aside%'",
                (f"aside{number}:", session.id, after),
            )

    def undo_set_aside(self, session: Session) -> bool:
        """The reply set aside last comes back in place of what replaced it; False when
        none was set aside since the last user message."""
        after = last_user_id(session)
        with self._lock, self.transaction():
            aside = self._set_aside(session.id, after)
            if not aside:
                return False
            last = max(n for n, _ in aside.values())
            self._db.execute(
                "DELETE FROM messages WHERE session_id = ? AND id > ? AND status NOT LIKE 'aside%'",
                (session.id, after),
            )
            for row_id, (n, status) in aside.items():
                if n == last:
                    self._db.execute(
                        "UPDATE messages SET status = ? WHERE id = ?", (status, row_id)
                    )
        session.messages = self._messages(session.id)
        return True

    def _set_aside(self, session_id: int, after: int) -> dict[int, tuple[int, str]]:
        """Messages set aside after message `after`: id -> (which time, the status they had)."""
        found = {}
        for row_id, status in self._db.execute(
            "SELECT id, status FROM messages WHERE session_id = ? AND id > ? "
            "AND status LIKE 'aside%'",
            (session_id, after),
        ):
            number, _, was = status.removeprefix("aside").partition(":")
            found[row_id] = (int(number), was)
        return found

    def delete_session(self, session_id: int) -> None:
        """The session, its messages and its subagents' sessions, all of them."""
        with self._lock:
            ids, frontier = [session_id], [session_id]
            while frontier:
                marks = ",".join("?" * len(frontier))
                frontier = [
                    row[0]
                    for row in self._db.execute(
                        f"SELECT id FROM sessions WHERE parent_id IN ({marks})", frontier
                    )
                ]
                ids += frontier
            marks = ",".join("?" * len(ids))
            self._db.execute(f"DELETE FROM sessions WHERE id IN ({marks})", ids)

    def setting(self, key: str, default=None):
        with self._lock:
            row = self._db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_setting(self, key: str, value) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO settings (key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, json.dumps(value)),
            )

    def sessions(self, kind: str | None = "chat") -> list[Session]:
        """Sessions of one kind (None: all, children too), oldest first, with messages."""
        return self._load("WHERE kind = ?", (kind,)) if kind is not None else self._load("", ())

    def session(self, session_id: int) -> Session | None:
        found = self._load("WHERE id = ?", (session_id,))
        return found[0] if found else None

    def _load(self, where: str, args: tuple) -> list[Session]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(SESSION_COLUMNS)} FROM sessions {where} ORDER BY id",
                args,
            ).fetchall()
            out = [Session(*row) for row in rows]
            for s in out:
                s.messages = self._messages(s.id)
        return out

    def _messages(self, session_id: int) -> list[StoredMessage]:
        return [
            StoredMessage.from_row(*row)
            for row in self._db.execute(
                "SELECT id, role, content, status, meta FROM messages WHERE session_id = ? "
                "AND status NOT LIKE 'aside%' ORDER BY id",
                (session_id,),
            )
        ]
