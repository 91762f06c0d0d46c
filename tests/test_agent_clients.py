"""What agent tools send, through their own client libraries, over real HTTP: Claude Code's
first request (its shape replayed), the anthropic SDK's structured output, litellm's
providers, legacy OpenAI functions, context overflow in each protocol's words, stop strings
beside forced output, and what is left out or refused by name. A tiny random model with a
long context serves them."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import jsonschema
import litellm
import ollama
import openai
import pydantic
import pytest
import torch

from lucedesk.chat.json_schema import LIMIT, check_value, grammar_schema
from lucedesk.chat.template import render_chat
from lucedesk.engine.models.loader import load_model
from lucedesk.server import create_app, start_server
from tests.conftest import write_tiny_model
from tests.engine_harness import make_engine

CONTEXT = 65536
CLAUDE_CODE = json.loads((Path(__file__).parent / "data" / "claude_code_request.json").read_text())
NUMBERS = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tags": {"type": "object"}},
    "required": ["n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A tiny llama with a context of 64k tokens whose tokenizer learnt from Claude Code's
    request (its ~124 KB then take ~30k tokens, as with a real model's vocabulary)."""
    folder = tmp_path_factory.mktemp("long") / "tiny-long"
    return write_tiny_model(folder, "llama", context=CONTEXT, corpus=json.dumps(CLAUDE_CODE))


@pytest.fixture(scope="module")
def server(long_model):
    engine = make_engine(
        load_model(long_model, torch.float32), max_slots=4, kv_pool_tokens=CONTEXT
    ).start()
    # As `lucedesk serve --served-model-name tiny --served-model-name claude-sonnet-4-5`.
    names = ["tiny", CLAUDE_CODE["body"]["model"]]
    running = start_server(create_app(engine, model_name=names), "127.0.0.1", 0)
    yield running.url, engine
    running.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def small_server(tiny_llama):
    """A context of 1024 tokens: what overflows it is cheap to send."""
    engine = make_engine(load_model(tiny_llama, torch.float32), max_slots=2).start()
    running = start_server(create_app(engine, model_name="tiny"), "127.0.0.1", 0)
    yield running.url, engine
    running.stop()
    engine.shutdown()


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


# -- Claude Code ------------------------------------------------------------------------------


def test_claude_code_first_request_is_answered(server):
    """Claude Code's first request as it sends it (its prose replaced by filler of the same
    length): three system blocks with cache_control, 25 tools whose schemas use
    propertyNames and draft 2020-12, max_tokens 32000 beyond the room left, thinking with a
    budget, context_management, metadata and its beta headers."""
    url, engine = server
    body = CLAUDE_CODE["body"]
    schemas = json.dumps([t["input_schema"] for t in body["tools"]])
    assert len(body["tools"]) >= 20 and "propertyNames" in schemas
    assert body["max_tokens"] == 32000 and body["thinking"]["type"] == "enabled"
    headers = CLAUDE_CODE["headers"] | {"x-api-key": "unused"}
    count = dict(model=body["model"], messages=body["messages"], system=body["system"])
    r = httpx.post(
        url + "/v1/messages/count_tokens?beta=true",
        json=count | {"tools": body["tools"]},
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    num_prompt = r.json()["input_tokens"]
    assert 10_000 < num_prompt < CONTEXT - 100  # a long prompt, with room left for a reply
    with httpx.stream(
        "POST", url + CLAUDE_CODE["path"], json=body, headers=headers, timeout=600
    ) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.read().decode())
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == num_prompt
    assert "error" not in kinds
    assert engine.stats().num_running == 0


def test_a_system_entry_inside_messages(server):
    url, _ = server
    reply = claude(url).messages.create(
        model="tiny",
        max_tokens=4,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "system", "content": "Answer briefly."},  # as Claude Code sends them
            {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
        ],
    )
    assert reply.type == "message" and reply.stop_reason in ("max_tokens", "end_turn")


def test_a_template_that_takes_one_system_message_gets_them_joined(tiny_llama):
    loaded = load_model(tiny_llama, torch.float32)
    tokenizer = loaded.tokenizer
    strict = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system only first') }}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    tokenizer.chat_template = strict
    messages = [
        {"role": "system", "content": "A."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "B."},
    ]
    assert render_chat(tokenizer, messages, False) == "[system]A.\n\nB.[user]hi"


# -- schemas the grammar cannot hold whole ----------------------------------------------------


def test_narrowing_keywords_leave_the_grammar_and_are_checked_after():
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string", "format": "int64"},  # a property named like a keyword
            "env": {"type": "object", "propertyNames": {"pattern": "^[A-Z]+$"}},
            "ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            "big": {"type": "integer", "minimum": -1e30, "maximum": 1e30},
        },
        "not": {"required": ["x"]},
    }
    loose = grammar_schema(schema, "tools[0]")
    assert loose.dropped == {
        "not",
        "propertyNames",
        "uniqueItems",
        "format int64",
        "minimum",
        "maximum",
    }
    props = loose.schema["properties"]
    assert set(props) == {"not", "env", "ids", "big"} and "not" not in loose.schema
    assert props["big"] == {"type": "integer"} and "propertyNames" not in props["env"]
    assert check_value(schema, {"env": {"PATH": 1}, "ids": [1, 2]}) is None
    problem = check_value(schema, {"env": {"lower": 1}})
    assert problem is not None and "env" in problem
    assert "non-unique" in check_value(schema, {"ids": [1, 1]})


@pytest.mark.parametrize(
    ("bound", "field"),
    [
        ({"minimum": 1e30}, "tools[0].properties.n.minimum"),
        ({"maximum": -1e30}, "tools[0].properties.n.maximum"),
        # The grammar library crashed the process on this one: it must never see it.
        ({"minimum": -1e30, "maximum": -1e29}, "tools[0].properties.n.maximum"),
        ({"exclusiveMinimum": 2**63}, "tools[0].properties.n.exclusiveMinimum"),
    ],
)
def test_bounds_no_number_can_meet_are_a_400_naming_them(server, bound, field):
    url, engine = server
    params = {
        "type": "object",
        "properties": {"n": {"type": "integer", **bound}},
        "required": ["n"],
    }
    with pytest.raises(openai.BadRequestError) as err:
        oai(url).chat.completions.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": "n?"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
            tool_choice="required",
        )
    error = err.value.body
    assert error["param"] == field and str(LIMIT) in error["message"], error
    assert engine.running


def test_claude_code_tools_are_called_with_arguments_their_grammar_holds(server):
    """A forced call of a tool whose schema uses propertyNames: the call is made and its
    arguments match the schema the grammar held."""
    url, _ = server
    tool = next(
        t for t in CLAUDE_CODE["body"]["tools"] if "propertyNames" in json.dumps(t["input_schema"])
    )
    reply = claude(url).messages.create(
        model="tiny",
        max_tokens=400,
        messages=[{"role": "user", "content": "go"}],
        tools=[tool],
        tool_choice={"type": "tool", "name": tool["name"]},
    )
    # Sampled (the request sets no temperature), and parallel calls are allowed: one call
    # or more, each of the forced tool.
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert calls and all(call.name == tool["name"] for call in calls)
    if reply.stop_reason == "tool_use":
        loose = grammar_schema(tool["input_schema"], "tools[0]").schema
        for call in calls:
            jsonschema.validate(call.input, loose)


# -- context overflow, in each protocol's words -----------------------------------------------


def test_max_tokens_beyond_the_room_left_is_capped(small_server):
    url, _ = small_server
    reply = oai(url).chat.completions.create(
        model="tiny",
        max_tokens=32000,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"ignore_eos": True},
    )
    usage = reply.usage
    assert reply.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == 1024
    message = claude(url).messages.create(
        model="tiny", max_tokens=20000, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("num_predict", [-1, -2])
def test_ollama_num_predict_unlimited_and_fill_mean_the_room_left(small_server, num_predict):
    url, _ = small_server
    reply = ollama.Client(host=url).generate(
        model="tiny",
        prompt="hi",
        raw=True,
        options={"num_predict": num_predict, "ignore_eos": True},
    )
    assert reply.done_reason == "length"
    assert reply.prompt_eval_count + reply.eval_count == 1024


LONG = "lorem ipsum dolor sit amet " * 400  # far beyond 1024 tokens


def test_a_prompt_that_does_not_fit_is_refused_in_each_protocols_words(small_server):
    url, engine = small_server
    with pytest.raises(openai.BadRequestError) as err:
        oai(url).chat.completions.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": LONG}]
        )
    error = err.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["message"].startswith("This model's maximum context length is 1024 tokens")
    with pytest.raises(anthropic.BadRequestError) as err:
        claude(url).messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": LONG}]
        )
    error = err.value.body["error"]
    assert error["type"] == "invalid_request_error"
    n = int(error["message"].split(": ")[1].split()[0])
    assert error["message"] == f"prompt is too long: {n} tokens > 1023 maximum" and n > 1024
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=url).chat(model="tiny", messages=[{"role": "user", "content": LONG}])
    assert err.value.status_code == 400
    assert "the input length exceeds the context length" in err.value.error
    with pytest.raises(openai.BadRequestError) as err:
        oai(url).responses.create(model="tiny", input=LONG, max_output_tokens=5)
    assert err.value.body["code"] == "context_length_exceeded"
    assert err.value.body["param"] == "input"
    assert engine.running


def test_litellm_sees_a_context_window_error(small_server):
    url, _ = small_server
    for model, base in (("openai/tiny", url + "/v1"), ("anthropic/tiny", url)):
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(
                model=model,
                api_base=base,
                api_key="unused",
                max_tokens=5,
                messages=[{"role": "user", "content": LONG}],
                num_retries=0,
            )


def test_litellm_ollama_chat_and_anthropic_round_trip(small_server):
    url, _ = small_server
    for model, base in (("ollama_chat/tiny", url), ("anthropic/tiny", url)):
        reply = litellm.completion(
            model=model,
            api_base=base,
            api_key="unused",
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            num_retries=0,
        )
        assert reply.choices[0].finish_reason in ("stop", "length"), model
        assert reply.usage.prompt_tokens > 0, model


# -- Anthropic structured output --------------------------------------------------------------


class Weather(pydantic.BaseModel):
    # Values a random model finishes: the SDK moves bounds (max_length, ge) out of the
    # schema it sends, into the descriptions.
    unit: Literal["c", "f"]
    days: Literal[1, 2, 3]
    hourly: bool


def test_anthropic_messages_parse_gets_its_schema_held(server):
    url, _ = server
    parsed = claude(url).messages.parse(
        model="tiny",
        max_tokens=200,
        messages=[{"role": "user", "content": "weather?"}],
        output_format=Weather,
    )
    assert isinstance(parsed.parsed_output, Weather)
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    reply = claude(url).messages.create(
        model="tiny",
        max_tokens=50,
        messages=[{"role": "user", "content": "a?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
    )
    assert json.loads(reply.content[0].text)["a"] in ("x", "y")


# -- calls cut by max_tokens, cached tokens ---------------------------------------------------

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": NUMBERS}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_leaks_no_marker(server, stream):
    url, _ = server
    for max_tokens in (1, 2, 3, 4):
        kwargs = dict(
            model="tiny",
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": "look it up"}],
            tools=[TOOL],
            tool_choice="required",
        )
        if stream:
            chunks = list(oai(url).chat.completions.create(**kwargs, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = oai(url).chat.completions.create(**kwargs).choices[0].message.content or ""
        assert "<" not in text, (max_tokens, text)
        message = claude(url).messages.create(
            model="tiny",
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": "look it up"}],
            tools=[{"name": "lookup", "input_schema": NUMBERS}],
            tool_choice={"type": "any"},
        )
        assert not [b for b in message.content if b.type == "text"], message.content


@pytest.mark.parametrize("stream", [False, True])
def test_responses_marks_a_cut_call_incomplete(server, stream):
    url, _ = server
    kwargs = dict(
        model="tiny",
        input="look it up",
        tools=[{"type": "function", "name": "lookup", "parameters": NUMBERS}],
        tool_choice="required",
    )
    # The fewest tokens that name the call and leave its arguments unfinished.
    for limit in range(8, 80, 2):
        output = oai(url).responses.create(**kwargs, max_output_tokens=limit).output
        if output[-1].type == "function_call":
            break
    kwargs["max_output_tokens"] = limit
    if stream:
        events = list(oai(url).responses.create(**kwargs, stream=True))
        response = events[-1].response
        assert events[-1].type == "response.incomplete"
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert done[-1].type == "function_call" and done[-1].status == "incomplete"
    else:
        response = oai(url).responses.create(**kwargs)
    assert response.status == "incomplete"
    assert response.output[-1].type == "function_call"
    assert response.output[-1].status == "incomplete"


def test_prefix_cache_hits_are_reported_as_cached_tokens(server):
    url, _ = server
    prompt = "a long shared prefix " * 60
    messages = [{"role": "user", "content": prompt}]
    oai(url).chat.completions.create(model="tiny", max_tokens=1, messages=messages)
    chat = oai(url).chat.completions.create(model="tiny", max_tokens=1, messages=messages)
    cached = chat.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= chat.usage.prompt_tokens
    streamed = list(
        oai(url).chat.completions.create(
            model="tiny",
            max_tokens=1,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached
    response = oai(url).responses.create(model="tiny", input=prompt, max_output_tokens=1)
    assert response.usage.input_tokens_details.cached_tokens > 0
    message = claude(url).messages.create(model="tiny", max_tokens=1, messages=messages)
    usage = message.usage
    assert usage.cache_read_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens


# -- mapped, left out, refused by name --------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_legacy_functions_are_answered_as_function_call(server, stream):
    url, _ = server
    kwargs = dict(
        model="tiny",
        max_tokens=200,
        messages=[{"role": "user", "content": "look it up"}],
        functions=[TOOL["function"]],
        function_call={"name": "lookup"},
    )
    if stream:
        chunks = list(oai(url).chat.completions.create(**kwargs, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [d.function_call for d in deltas if d.function_call is not None]
        name = calls[0].name
        arguments = "".join(c.arguments or "" for c in calls)
        reason = chunks[-1].choices[0].finish_reason
        assert not any(d.tool_calls for d in deltas)
    else:
        message = oai(url).chat.completions.create(**kwargs).choices[0]
        reason, call = message.finish_reason, message.message.function_call
        name, arguments = call.name, call.arguments
        assert message.message.tool_calls is None
    assert name == "lookup"
    if reason == "function_call":
        jsonschema.validate(json.loads(arguments), NUMBERS)
    else:
        assert reason == "length"
    follow_up = oai(url).chat.completions.create(
        model="tiny",
        max_tokens=3,
        messages=[
            {"role": "user", "content": "look it up"},
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": name, "arguments": "{}"},
            },
            {"role": "function", "name": name, "content": "42"},
        ],
        functions=[TOOL["function"]],
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length", "function_call")
    with pytest.raises(openai.BadRequestError) as err:
        oai(url).chat.completions.create(
            model="tiny",
            max_tokens=3,
            messages=[{"role": "function", "name": "lookup", "content": "42"}],
            functions=[TOOL["function"]],
        )
    assert err.value.body["param"] == "messages[0].name"


def test_anthropic_server_tools_are_left_out(server):
    url, _ = server
    message = claude(url).messages.create(
        model="tiny",
        max_tokens=200,
        messages=[{"role": "user", "content": "look it up"}],
        tools=[
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
            {"name": "lookup", "input_schema": NUMBERS},
        ],
        tool_choice={"type": "any"},
    )
    calls = [b.name for b in message.content if b.type == "tool_use"]
    assert calls and set(calls) == {"lookup"}


def test_image_parts_are_refused_by_name(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as err:
        oai(url).chat.completions.create(
            model="tiny",
            max_tokens=3,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                }
            ],
        )
    error = err.value.body
    assert error["param"] == "messages[0].content"
    assert "images are not supported by the loaded model" in error["message"]


# -- stop strings beside forced output --------------------------------------------------------


def test_stop_strings_never_cut_a_forced_call_or_schema(server):
    url, _ = server
    reply = oai(url).chat.completions.create(
        model="tiny",
        max_tokens=300,
        messages=[{"role": "user", "content": "look it up"}],
        tools=[TOOL],
        tool_choice="required",
        stop=["<", "{", '"'],
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "lookup"
    if choice.finish_reason == "tool_calls":
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), NUMBERS)
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x:y", "aa", "b:a"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    reply = oai(url).chat.completions.create(
        model="tiny",
        max_tokens=300,
        messages=[{"role": "user", "content": "a?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        stop=[":", "a"],
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_stop_strings_still_end_free_text_beside_tools(server):
    url, _ = server
    stops = ["e", "a", "o", " ", "t", "i", "n", "s"]
    for seed in range(4):
        reply = oai(url).chat.completions.create(
            model="tiny",
            max_tokens=200,
            seed=seed,
            messages=[{"role": "user", "content": "hi"}],
            tools=[TOOL],
            stop=stops,
        )
        choice = reply.choices[0]
        text = choice.message.content or ""
        assert not any(s in text for s in stops), text
        if not choice.message.tool_calls and choice.finish_reason != "length":
            assert choice.finish_reason == "stop"


# -- errors that name the protocol's own field ------------------------------------------------


def test_errors_name_each_protocols_own_field(server):
    url, _ = server
    r = httpx.post(
        url + "/v1/messages",
        json={
            "model": "tiny",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
            "stop_sequences": [f"stop-{i}" for i in range(1000)],
        },
    )
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("stop_sequences may hold at most 16 strings") and len(message) < 200
    r = httpx.post(
        url + "/api/chat",
        json={
            "model": "tiny",
            "stream": False,
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"stop": [""]},
        },
    )
    assert r.status_code == 400 and r.json()["error"].startswith("options.stop ")


# -- a big request does not hold up the others ------------------------------------------------


def test_a_huge_prompt_does_not_stall_other_clients(small_server):
    """Tokenizing a 4 MB prompt takes seconds; meanwhile /health keeps answering."""
    url, engine = small_server
    huge = "lorem ipsum dolor sit amet " * 150_000
    result = {}

    def send():
        result["r"] = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": huge}]},
            timeout=300,
        )

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.05)
    sender.join()
    assert result["r"].status_code == 400
    assert result["r"].json()["error"]["code"] == "context_length_exceeded"
    # Seconds of tokenizing held no lock the loop needs (generous for a loaded machine).
    assert slowest < 1.5, slowest
