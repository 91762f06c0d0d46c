"""A stored message's typed fields: what the store writes of them (only those set), what it
reads back (rows of older stores too), and what the model and the reader see of them."""

from __future__ import annotations

import json
import sqlite3

from lucedesk.chat import ChatMessage, ToolCall
from lucedesk.store import Store, StoredMessage


def test_a_reply_and_a_tool_result_come_back_from_the_store_as_they_were_saved(tmp_path):
    store = Store(tmp_path / "s.db")
    session = store.create_session("typed")
    store.add_message(session, StoredMessage("user", "/fanout 2 look", prompt="Split it."))
    reply = store.begin_reply(session, split=2)
    reply.reasoning, reply.cut = "Thinking.", True
    reply.tool_calls = [ToolCall("c1", "list_dir", '{"path": "."}')]
    store.update_reply(reply, "Looking.", "done")
    call = StoredMessage("tool", "", "streaming", tool_call_id="c1", name="list_dir")
    call.arguments = '{"path": "."}'
    store.add_message(session, call)
    call.error = "error: path: nowhere"
    store.update_reply(call, call.error, "done")
    store.close()

    again = Store(tmp_path / "s.db")
    user, read_reply, read_call = again.session(session.id).messages
    again.close()
    assert (user.content, user.prompt) == ("/fanout 2 look", "Split it.")
    assert read_reply.id == reply.id and read_reply.status == "done"
    assert (read_reply.reasoning, read_reply.cut, read_reply.split) == ("Thinking.", True, 2)
    assert read_reply.tool_calls == reply.tool_calls
    assert (read_call.name, read_call.arguments, read_call.tool_call_id) == (
        "list_dir",
        '{"path": "."}',
        "c1",
    )
    assert read_call.error == "error: path: nowhere"
    # Only what is set is written; a tool result always says whether it failed.
    assert user.meta() == {"prompt": "Split it."}
    assert read_call.meta() == {
        "error": True,
        "tool_call_id": "c1",
        "name": "list_dir",
        "arguments": '{"path": "."}',
    }


def test_rows_an_older_store_wrote_read_as_typed_messages(tmp_path):
    store = Store(tmp_path / "s.db")
    session = store.create_session("old")
    store.close()
    rows = [
        ("tool", "error: no such file", {"tool_call_id": "a", "name": "x", "error": True}),
        ("tool", "found", {"tool_call_id": "b", "name": "x", "error": False}),
        ("assistant", "", {"tool_calls": [{"id": "a", "name": "x", "arguments": "{}"}]}),
        ("assistant", "cut", {"cut": True, "someday": "a key this version does not know"}),
    ]
    with sqlite3.connect(tmp_path / "s.db") as db:
        for role, content, meta in rows:
            db.execute(
                "INSERT INTO messages (session_id, role, content, created, meta) "
                "VALUES (?, ?, ?, 0, ?)",
                (session.id, role, content, json.dumps(meta)),
            )
    again = Store(tmp_path / "s.db")
    failed, found, asked, cut = again.session(session.id).messages
    again.close()
    assert failed.error == "error: no such file" and found.error == ""
    assert asked.tool_calls == [ToolCall("a", "x", "{}")]
    assert cut.cut and cut.notes() == ["max tokens"]


def test_what_the_model_sees_of_stored_messages():
    call = ToolCall("c1", "list_dir", "{}")
    messages = [
        StoredMessage("user", "/fanout 2 x", prompt="Split x."),
        StoredMessage("assistant", "", reasoning="Hm.", tool_calls=[call]),
        StoredMessage("tool", "a.txt", tool_call_id="c1", name="list_dir"),
    ]
    assert [m.chat_message() for m in messages] == [
        ChatMessage("user", "Split x."),
        ChatMessage("assistant", "", [call], "Hm."),
        ChatMessage("tool", "a.txt", tool_call_id="c1", name="list_dir"),
    ]
    assert StoredMessage("assistant", "x", "interrupted", error="boom").notes() == ["interrupted"]
    assert StoredMessage("assistant", "x", error="boom").notes() == ["error: boom"]
    assert StoredMessage("assistant", "x", stopped=True).notes() == ["stopped"]
