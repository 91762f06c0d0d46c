"""The typed chat every protocol converts into (engine/messages.py): what a plain dict may
say, the rule that a tool result answers an earlier call, and the shapes handed on."""

from __future__ import annotations

import pytest

from lucedesk.chat import CallLedger, ChatMessage, ToolCall
from lucedesk.chat.messages import chat_messages
from lucedesk.engine import RequestError


def test_plain_dicts_become_typed_messages_and_bad_ones_name_the_field():
    call = {"id": "c1", "name": "f", "arguments": "{}"}
    chat = chat_messages(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "r"},
            {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "f"},
        ]
    )
    assert chat == [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "", [ToolCall("c1", "f", "{}")], "r"),
        ChatMessage("tool", "ok", tool_call_id="c1", name="f"),
    ]
    for bad, field in [
        ({"role": "robot", "content": "x"}, "messages[0].role"),
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}, "tool_calls[0].name"),
        ("hello", "messages[0]"),
    ]:
        with pytest.raises(RequestError) as caught:
            chat_messages([bad])
        assert caught.value.field.endswith(field)


def test_a_tool_result_answers_an_earlier_call_by_id_or_the_earliest_unanswered():
    ledger = CallLedger()
    first = ledger.made(ToolCall("a", "read", "{}"))
    ledger.made(ToolCall("b", "grep", "{}"))
    assert ledger.answer("b", "found", "x", "tool call") == ChatMessage(
        "tool", "found", tool_call_id="b", name="grep"
    )
    assert ledger.answer_next(None, "text", "y").tool_call_id == first.id
    with pytest.raises(RequestError, match="'zz' matches no tool_use of an earlier message"):
        ledger.answer("zz", "", "messages[3].content[0].tool_use_id", "tool_use")
    with pytest.raises(RequestError, match="no earlier tool call awaits one"):
        ledger.answer_next(None, "", "messages[4]")
    with pytest.raises(RequestError, match=r"input\[2\].arguments is not valid JSON"):
        ledger.made(ToolCall("c", "f", '{"a": '), "input[2].arguments")


def test_calls_are_handed_on_in_each_shape_and_a_cut_call_keeps_its_text_for_the_model():
    cut = ToolCall("c1", "write", '{"path": "a.txt", "text": "hel')
    whole = ToolCall("c2", "read", '{"path": "a.txt"}')
    assert cut.arguments_object() == {} and whole.arguments_object() == {"path": "a.txt"}
    assert cut.arguments_value() == cut.arguments  # the template shows what the model wrote
    reply = ChatMessage("assistant", "", [whole])
    assert reply.openai() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "read", "arguments": whole.arguments},
            }
        ],
    }
    template = reply.for_template()
    assert template["content"] == "" and template["tool_calls"][0]["function"]["arguments"] == {
        "path": "a.txt"
    }
    result = ChatMessage("tool", "text", tool_call_id="c2", name="read")
    assert result.openai() == {"role": "tool", "content": "text", "tool_call_id": "c2"}
    assert result.for_template()["name"] == "read"
    assert ToolCall.from_dict(whole.to_dict()) == whole
