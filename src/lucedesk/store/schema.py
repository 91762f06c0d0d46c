"""The store's tables, each column declared once: the tables are created from these
declarations, and a store written by an older lucedesk gains the columns added since."""

from __future__ import annotations

import sqlite3

TABLES: dict[str, dict[str, str]] = {
    "sessions": {
        "id": "INTEGER PRIMARY KEY AUTOINCREMENT",
        "title": "TEXT NOT NULL",
        "system_prompt": "TEXT NOT NULL DEFAULT ''",
        "temperature": "REAL NOT NULL DEFAULT 0.7",
        "max_tokens": "INTEGER NOT NULL DEFAULT 512",
        "kind": "TEXT NOT NULL DEFAULT 'chat'",
        "parent_id": "INTEGER",
        "created": "REAL NOT NULL",
        "backend_url": "TEXT NOT NULL DEFAULT ''",
        # idle | running | done | cancelled | error | interrupted
        "status": "TEXT NOT NULL DEFAULT 'idle'",
        "agent_type": "TEXT NOT NULL DEFAULT 'chat'",  # chat (no tools) | explore | general
        "workspace": "TEXT NOT NULL DEFAULT ''",
        "owner": "TEXT NOT NULL DEFAULT ''",  # the Owner token of the process running it
    },
    "messages": {
        "id": "INTEGER PRIMARY KEY AUTOINCREMENT",
        "session_id": "INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE",
        "role": "TEXT NOT NULL",
        "content": "TEXT NOT NULL",
        "created": "REAL NOT NULL",
        # done | streaming | interrupted | aside<n>:<the status it had> (set aside by Ctrl+R)
        "status": "TEXT NOT NULL DEFAULT 'done'",
        "meta": "TEXT NOT NULL DEFAULT '{}'",
        "owner": "TEXT NOT NULL DEFAULT ''",  # the Owner token of the process writing it
    },
    "settings": {  # the TUI's layout: open panes, what is shown
        "key": "TEXT PRIMARY KEY",
        "value": "TEXT NOT NULL",
    },
}


def create_tables(db: sqlite3.Connection) -> None:
    """Every table, with the columns an older store lacks added (each column added after the
    first release has a default, so existing rows take it)."""
    for table, columns in TABLES.items():
        declared = ", ".join(f"{name} {decl}" for name, decl in columns.items())
        db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({declared})")
        present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for name, decl in columns.items():
            if name not in present:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
