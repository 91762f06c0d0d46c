"""Tool calling, response formats and logprobs over real HTTP, the openai client as client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.server import create_app, start_server
from tests.engine_harness import make_engine

MODEL = "tiny-llama"
PARAMS = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
    },
    "required": ["unit", "days", "hourly"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": PARAMS}},
    {
        "type": "function",
        "function": {
            "name": "now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
USER = [{"role": "user", "content": "What will the weather be?"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = make_engine(
        load_model(tiny_llama, torch.float32), max_slots=4, kv_pool_tokens=8192
    ).start()
    running = start_server(create_app(engine, model_name=MODEL), "127.0.0.1", 0)
    yield running, engine
    running.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def stream_calls(chunks) -> tuple[str, list[dict], str]:
    text, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "id sent once"
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
        reason = choice.finish_reason or reason
    return text, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "forecast"}}]
)
def test_forced_tool_call_has_schema_valid_arguments(client, choice):
    kwargs = dict(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if call.function.name == "forecast":
        jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    else:
        assert choice == "required" and isinstance(json.loads(call.function.arguments), dict)
    text, calls, reason = stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert reason == "tool_calls" and text == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_follow_up_turn_with_the_tool_result_is_answered(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        parallel_tool_calls=False,
    )
    call = r.choices[0].message.tool_calls[0]
    follow = client.chat.completions.create(
        model=MODEL,
        messages=[
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert follow.choices[0].finish_reason == "length"
    assert follow.choices[0].message.tool_calls is None
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_validates(client, stream):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "state", "schema": SCHEMA, "strict": True},
    }
    for endpoint in ("chat", "completions"):
        common = dict(model=MODEL, max_tokens=60, temperature=0.8, seed=3, response_format=fmt)
        if endpoint == "chat":
            out = client.chat.completions.create(messages=USER, stream=stream, **common)
            text = (
                "".join(c.choices[0].delta.content or "" for c in out if c.choices)
                if stream
                else out.choices[0].message.content
            )
        else:
            out = client.completions.create(
                prompt="State:",
                stream=stream,
                extra_body=common.pop("response_format") and {"response_format": fmt},
                **common,
            )
            text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_response_is_an_object(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(
        model=MODEL,
        messages=USER,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    # A token may hold part of a character: its bytes, joined, are the text.
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", "replace") == r.choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]


def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL,
        prompt="The quick",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # greedy: each token is the most likely one (the legacy dict merges tokens of equal text)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and value == pytest.approx(max(top.values()))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(v <= 0 for v in lp.token_logprobs)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick",
            max_tokens=5,
            temperature=0,
            logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == lp.text_offset  # running on across chunks, not restarting


CALL = {"id": "call_a", "type": "function", "function": {"name": "now", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {
                "tools": [
                    TOOLS[0],
                    {
                        "type": "function",
                        "function": {
                            "name": "b",
                            "parameters": {"type": "object", "properties": {"x": {"type": 7}}},
                        },
                    },
                ]
            },
            "tools[1]",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"messages": [*USER, {"role": "tool", "tool_call_id": "call_zz", "content": "x"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [{**CALL, "function": {"name": "now", "arguments": "{oops"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ],
)
def test_bad_tool_and_format_fields_get_a_400_naming_them(server, change, param):
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, **change}
    r = httpx.post(server[0].url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert server[1].stats().num_running == 0
