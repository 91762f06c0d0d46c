"""Anthropic, Responses and Ollama routes on a tiny model over real HTTP: each protocol's
error shape, disconnects that free the slot, model names."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.server import create_app, start_server
from tests.conftest import wait_until
from tests.engine_harness import make_engine


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = make_engine(load_model(tiny_llama, torch.float32), max_slots=4, kv_pool_tokens=8192)
    # The tiny model needs ~1 ms a step: 5 ms more keeps a 900-token reply running ~5 s, so
    # a test can watch it run and see the slot come back only because its client left.
    execute = engine.seq_engine.execute

    def slowed(plan):
        time.sleep(0.005)
        return execute(plan)

    engine.seq_engine.execute = slowed
    engine.start()
    running = start_server(create_app(engine, model_name=["tiny", "alias-2"]), "127.0.0.1", 0)
    yield running.url, engine
    running.stop()
    engine.shutdown()


LONG = {"max_tokens": 900, "ignore_eos": True}
STREAMS = [
    (
        "/v1/messages",
        {
            "model": "tiny",
            "max_tokens": 900,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
    ("/v1/responses", {"model": "tiny", "max_output_tokens": 900, "stream": True, "input": "hi"}),
    (
        "/api/chat",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 900, "ignore_eos": True},
        },
    ),
    (
        "/api/generate",
        {"model": "tiny", "prompt": "hi", "options": {"num_predict": 900, "ignore_eos": True}},
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "max_tokens": 900,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
]


@pytest.mark.parametrize(("path", "body"), STREAMS, ids=[p for p, _ in STREAMS])
def test_a_client_leaving_mid_stream_frees_its_slot(server, path, body):
    url, engine = server
    body = {**body, "ignore_eos": True}
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        wait_until(lambda: engine.stats().num_running == 1, 10)
        cancelled = engine.stats().finish_reasons.get("cancelled", 0)
    # The slot comes back because the client left: the request was cancelled, not finished
    # (900 tokens take ~5 s here), and its blocks are free.
    wait_until(lambda: engine.stats().num_running == 0 and engine.stats().blocks_used == 0, 10)
    assert engine.stats().finish_reasons.get("cancelled", 0) == cancelled + 1


def test_model_names(server):
    url, _ = server
    entry = httpx.get(url + "/v1/models").json()["data"][0]
    assert entry["id"] == "tiny" and entry["aliases"] == ["llama", "default", "alias-2"]
    for name in ("tiny", "llama", "default", "alias-2"):
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 200, name
    tags = httpx.get(url + "/api/tags").json()["models"]
    assert [m["name"] for m in tags] == ["tiny"]


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        (
            "/v1/messages",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
            400,
            "max_tokens",
        ),
        (
            "/v1/messages",
            {"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]},
            404,
            "nope",
        ),
        (
            "/v1/messages",
            {
                "model": "tiny",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "images are not supported",
        ),
        (
            "/v1/messages",
            {
                "model": "tiny",
                "max_tokens": 3,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}
                        ],
                    }
                ],
            },
            400,
            "tool_use_id",
        ),
        (
            "/v1/messages",
            {
                "model": "tiny",
                "max_tokens": 3,
                "tool_choice": {"type": "tool", "name": "zz"},
                "tools": [{"name": "a", "input_schema": {"type": "object"}}],
                "messages": [{"role": "user", "content": "x"}],
            },
            400,
            "tool_choice",
        ),
    ],
)
def test_anthropic_errors_in_anthropic_shape(server, path, body, status, says):
    url, engine = server
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and says in error["error"]["message"]
    assert error["error"]["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"
    )
    assert engine.stats().num_running == 0


def test_anthropic_accepts_x_api_key(tiny_llama):  # and either of two headers
    engine = make_engine(
        load_model(tiny_llama, torch.float32), max_slots=1, kv_pool_tokens=1024
    ).start()
    running = start_server(create_app(engine, api_key="sekrit"), "127.0.0.1", 0)
    try:
        body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        r = httpx.post(running.url + "/v1/messages", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (
            httpx.post(
                running.url + "/v1/messages", json=body, headers={"x-api-key": "sekrit"}
            ).status_code
            == 200
        )
        r = httpx.post(running.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
        assert r.status_code == 401
        both = {"x-api-key": "sekrit", "Authorization": "Bearer unused"}
        assert httpx.post(running.url + "/v1/messages", json=body, headers=both).status_code == 200
    finally:
        running.stop()
        engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        (
            "/api/chat",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
            "nope",
        ),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["AA"]}]},
            400,
            "images are not supported",
        ),
        (
            "/api/chat",
            {"model": "tiny", "format": "yaml", "messages": [{"role": "user", "content": "x"}]},
            400,
            "format",
        ),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]},
            400,
            "tool",
        ),
        (
            "/api/generate",
            {"model": "tiny", "prompt": "x", "options": {"temperature": 9}},
            400,
            "temperature",
        ),
        ("/api/embed", {"model": "tiny", "input": "x"}, 501, "embeddings"),
        ("/api/show", {"model": "gpt-9"}, 404, "gpt-9"),
    ],
)
def test_ollama_errors_in_ollama_shape(server, path, body, status, says):
    url, engine = server
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and says in r.json()["error"]
    assert engine.stats().num_running == 0


def test_ollama_stream_is_ndjson_with_a_done_line(server):
    url, _ = server
    body = {"model": "tiny", "prompt": "hi", "options": {"num_predict": 5, "temperature": 0}}
    r = httpx.post(url + "/api/generate", json={**body, "ignore_eos": True}, timeout=30)
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
    assert lines[-1]["done_reason"] in ("stop", "length")
    assert lines[-1]["eval_count"] <= 5
    whole = httpx.post(url + "/api/generate", json={**body, "stream": False}, timeout=30).json()
    assert whole["response"] == "".join(line["response"] for line in lines)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": [1], "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {
                "input": "x",
                "text": {
                    "format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}
                },
            },
            "text.format",
        ),
        ({"input": "x", "model": "gpt-5"}, "model"),
    ],
)
def test_responses_errors_in_openai_shape(server, body, param):
    url, engine = server
    r = httpx.post(url + "/v1/responses", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert engine.stats().num_running == 0


def test_default_survives_a_model_switch(tiny_models):
    """The TUI's /model rebuilds the engine under a live app: `default` keeps working."""
    engines = [
        make_engine(load_model(tiny_models[arch], torch.float32), max_slots=1, kv_pool_tokens=1024)
        for arch in ("llama", "qwen3")
    ]
    current = {"engine": engines[0].start()}
    running = start_server(create_app(lambda: current["engine"]), "127.0.0.1", 0)
    body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    try:
        first = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=30).json()
        current["engine"] = engines[1].start()
        second = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=30).json()
        assert (first["model"], second["model"]) == ("llama", "qwen3")
        old = {**body, "model": "llama"}
        r = httpx.post(running.url + "/v1/chat/completions", json=old, timeout=30)
        assert r.status_code == 404
    finally:
        running.stop()
        for engine in engines:
            engine.shutdown()


def test_user_mistakes_never_500(server):
    url, engine = server
    lone = "\ud800"
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": lone}]}, 400),
        (
            "/v1/responses",
            {"input": "hi", "text": {"verbosity": lone}, "max_output_tokens": 2},
            200,
        ),
        ("/v1/responses", {"input": lone}, 400),
        ("/tokenize", {"content": lone}, 400),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "seed": 2**70},
            400,
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
                "n": None,
                "stream": None,
                "logprobs": None,
                "ignore_eos": None,
                "parallel_tool_calls": None,
            },
            200,
        ),
        (
            "/api/chat",
            {
                "model": "tiny",
                "stream": False,
                "options": {"num_predict": 2},
                "messages": [{"role": "user", "content": None}],
            },
            200,
        ),
        ("/api/show", {"model": "tiny:latest"}, 200),
    ]
    for path, body, status in cases:
        raw = json.dumps({"model": "tiny", **body}).encode()  # lone surrogates escaped
        r = httpx.post(
            url + path, content=raw, headers={"content-type": "application/json"}, timeout=30
        )
        assert r.status_code == status, (path, body, r.text)
    r = httpx.post(
        url + "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert "malformed JSON" in r.json()["error"]["message"]
    wait_until(lambda: engine.stats().num_running == 0)


def test_responses_leave_out_hosted_tools(server):
    url, _ = server
    r = httpx.post(
        url + "/v1/responses",
        json={
            "model": "tiny",
            "input": "x",
            "max_output_tokens": 2,
            "tools": [
                {"type": "web_search"},
                {
                    "type": "function",
                    "name": "f",
                    "parameters": {"type": "object", "properties": {}},
                },
            ],
        },
        timeout=30,
    )
    assert r.status_code == 200 and [t["type"] for t in r.json()["tools"]] == [
        "web_search",
        "function",
    ]


def test_a_chunked_body_over_the_limit_is_a_413(tiny_llama):
    engine = make_engine(load_model(tiny_llama, torch.float32), max_slots=1, kv_pool_tokens=1024)
    running = start_server(create_app(engine, max_body_bytes=1000), "127.0.0.1", 0)
    try:

        def chunks():
            for _ in range(20):
                yield b" " * 100

        r = httpx.post(
            running.url + "/v1/messages",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413 and r.json()["type"] == "error"
    finally:
        running.stop()


def test_anthropic_reports_the_stop_sequence(server):
    url, engine = server
    prompt = {
        "model": "tiny",
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": "The quick brown fox"}],
    }
    # The same greedy reply, run to its length through the chat route (Anthropic's has no
    # ignore_eos); the messages render to the same prompt, so the tokens are the same.
    free = httpx.post(
        url + "/v1/chat/completions", json={**prompt, "ignore_eos": True}, timeout=30
    ).json()
    text = free["choices"][0]["message"]["content"]
    stop = next(  # two characters first seen after the start
        text[i : i + 2] for i in range(1, len(text) - 1) if text.find(text[i : i + 2]) == i
    )
    r = httpx.post(
        url + "/v1/messages", json={**prompt, "stop_sequences": ["zzzz", stop]}, timeout=30
    ).json()
    assert r["stop_reason"] == "stop_sequence" and r["stop_sequence"] == stop
    assert r["content"][0]["text"] == text[: text.index(stop)]
