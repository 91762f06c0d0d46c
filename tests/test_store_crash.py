"""Crash safety of the session store: WAL as SQLite reports it, a `kill -9` in the middle of
a reply loses nothing that was written, transactions land whole; replies set aside by a
regenerate come back, deleting a session takes its subagents with it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from lucedesk.chat import ChatMessage
from lucedesk.store import Store, StoredMessage

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from lucedesk.store import Store, StoredMessage

    store = Store(Path(sys.argv[1]))
    session = store.create_session("crash")
    store.set_status(session, "running")
    for i in range(3):
        store.add_message(session, StoredMessage("user", f"question {i}"))
        reply = store.begin_reply(session)
        if i < 2:
            store.update_reply(reply, f"answer {i}", status="done")
            continue
        text = ""
        while True:  # the reply in flight, saved as it grows, until the process is killed
            text += "x"
            store.update_reply(reply, text)
            print(len(text), flush=True)
            time.sleep(0.01)
    """
)


def test_the_store_runs_in_wal_mode_as_sqlite_reports(tmp_path):
    store = Store(tmp_path / "s.db")
    assert store.journal_mode == "wal"
    with sqlite3.connect(tmp_path / "s.db") as other:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_kill_9_mid_reply_keeps_every_written_message(tmp_path):
    path = tmp_path / "s.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    acknowledged = 0
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 25:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL

    store = Store(path)
    [session] = store.sessions()
    messages = [(m.role, m.content, m.status) for m in session.messages]
    assert messages[:5] == [
        ("user", "question 0", "done"),
        ("assistant", "answer 0", "done"),
        ("user", "question 1", "done"),
        ("assistant", "answer 1", "done"),
        ("user", "question 2", "done"),
    ]
    role, content, status = messages[5]
    assert (role, status) == ("assistant", "interrupted")
    # Every update acknowledged before the kill is there (one more may have landed).
    assert content == "x" * len(content) and len(content) >= acknowledged
    assert len(messages) == 6
    # The interrupted reply is not sent to the model as if it were being written.
    assert session.chat_messages()[-1] == ChatMessage("assistant", content)
    store.close()


def test_a_store_opened_beside_a_live_process_leaves_its_work_running(tmp_path):
    """A TUI and a headless agent share the store: opening it marks only the work of a
    process that is gone."""
    path = tmp_path / "s.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if int(line) >= 3:  # its reply is being written
            break
    beside = Store(path)
    [session] = beside.sessions()
    assert session.status == "running" and session.messages[-1].status == "streaming"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    beside.interrupt_orphans()  # the writer is gone now
    [session] = beside.sessions()
    assert session.status == "interrupted" and session.messages[-1].status == "interrupted"
    beside.close()
    assert list((tmp_path / "s.db.owners").iterdir()) == []  # no lock file left behind


def test_a_transaction_lands_whole_or_not_at_all(tmp_path):
    store = Store(tmp_path / "s.db")
    parent = store.create_session("parent")
    with pytest.raises(RuntimeError):
        with store.transaction():
            child = store.create_session("child", kind="subagent", parent_id=parent.id)
            store.add_message(child, StoredMessage("user", "task"))
            raise RuntimeError("crashed halfway")
    assert store.sessions("subagent") == []
    with store.transaction():
        child = store.create_session("child", kind="subagent", parent_id=parent.id)
        store.add_message(child, StoredMessage("user", "task"))
    [saved] = store.sessions("subagent")
    assert saved.parent_id == parent.id and saved.messages[0].content == "task"
    store.close()


def test_an_old_store_gains_message_status(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE sessions (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, "
            "system_prompt TEXT NOT NULL DEFAULT '', temperature REAL NOT NULL DEFAULT 0.7, "
            "max_tokens INTEGER NOT NULL DEFAULT 512, kind TEXT NOT NULL DEFAULT 'chat', "
            "parent_id INTEGER, created REAL NOT NULL, backend_url TEXT NOT NULL DEFAULT '');"
            "CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id INTEGER "
            "NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL);"
            "INSERT INTO sessions (title, created) VALUES ('old', 0);"
            "INSERT INTO messages (session_id, role, content, created) VALUES (1, 'user', 'hi', 0);"
        )
    store = Store(path)
    [session] = store.sessions()
    assert session.messages[0].status == "done" and session.messages[0].content == "hi"
    store.close()


def test_a_reply_set_aside_comes_back_and_survives_a_reopen(tmp_path):
    store = Store(tmp_path / "s.db")
    session = store.create_session("regenerated")
    store.add_message(session, StoredMessage("user", "question"))
    first = store.begin_reply(session)
    first.stopped = True
    store.update_reply(first, "first answer", "done")
    store.set_aside_reply(session)  # Ctrl+R
    assert [m.content for m in session.messages] == ["question"]
    store.update_reply(store.begin_reply(session), "second answer", "done")
    store.set_aside_reply(session)  # and again
    store.update_reply(store.begin_reply(session), "third answer", "done")
    assert [m.content for m in store.session(session.id).messages] == [
        "question",
        "third answer",
    ]
    assert store.undo_set_aside(session)
    assert [m.content for m in session.messages] == ["question", "second answer"]
    assert store.undo_set_aside(session)
    assert [m.content for m in session.messages] == ["question", "first answer"]
    assert session.messages[-1].meta() == {"stopped": True}
    assert not store.undo_set_aside(session)  # nothing more set aside
    store.close()
    again = Store(tmp_path / "s.db")
    assert [m.content for m in again.session(session.id).messages] == [
        "question",
        "first answer",
    ]
    again.close()


def test_deleting_a_session_deletes_its_subagents_and_their_messages(tmp_path):
    store = Store(tmp_path / "s.db")
    parent = store.create_session("parent")
    child = store.create_session("child", kind="subagent", parent_id=parent.id)
    grandchild = store.create_session("grandchild", kind="subagent", parent_id=child.id)
    other = store.create_session("other")
    for s in (parent, child, grandchild, other):
        store.add_message(s, StoredMessage("user", "hi"))
    store.delete_session(parent.id)
    assert [s.id for s in store.sessions(None)] == [other.id]
    with sqlite3.connect(tmp_path / "s.db") as db:
        assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 1
    store.close()
