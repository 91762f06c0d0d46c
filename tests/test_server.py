"""The OpenAI-compatible server on real uvicorn, on an ephemeral port, with the official
`openai` client as the client."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.errors import ConfigError
from lucedesk.server import check_host, create_app, start_server
from tests.conftest import wait_until
from tests.engine_harness import make_engine

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load_model(tiny_llama, torch.float32)


@pytest.fixture(scope="module")
def server(loaded):
    engine = make_engine(loaded, max_slots=8, kv_pool_tokens=8192, max_model_len=1024).start()
    running = start_server(create_app(engine, model_name=MODEL), "127.0.0.1", 0)
    yield running, engine
    running.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    running, _ = server
    return openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_shape_and_text(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole


def test_text_content_parts_and_system(server, client, loaded):
    """The system message and every text part reach the template, in order: the prompt the
    engine ran is the template's rendering of exactly these messages."""
    from lucedesk.chat.template import render_chat

    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
    ]
    r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=messages)
    expected = render_chat(
        loaded.tokenizer,
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
    )
    assert "be brief" in expected and "hi there" in expected
    assert r.usage.prompt_tokens == len(loaded.tokenizer.encode(expected, add_special_tokens=False))
    shown = httpx.post(server[0].url + "/apply-template", json={"messages": messages}).json()
    assert shown["prompt"] == expected


def test_completions_string_and_token_ids(client):
    r = client.completions.create(
        model=MODEL,
        prompt="def add(a, b):",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.usage.completion_tokens == 8
    r2 = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7, 8],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r2.usage.prompt_tokens == 4 and r2.usage.completion_tokens == 3


def test_seed_reproduces(client):
    kwargs = dict(
        model=MODEL,
        prompt="the",
        max_tokens=16,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert client.completions.create(**kwargs).choices[0].text == (
        client.completions.create(**kwargs).choices[0].text
    )


def test_stop_sequences(client):
    base = dict(
        model=MODEL,
        prompt="the quick brown",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    free = client.completions.create(**base).choices[0].text
    stop = free[4:7]
    r = client.completions.create(**base, stop=[stop, "zzzz"])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text


def test_async_client_streams(server):
    running, _ = server

    async def main():
        client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        plain = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6
        )
        await client.close()
        return chunks, plain

    chunks, plain = asyncio.run(main())
    assert chunks[-1].usage.completion_tokens == 6
    assert plain.choices[0].message.content is not None


def test_32_concurrent_streams_get_exact_counts(server, client):
    counts: list[int] = []
    failures: list[str] = []

    def one(i: int) -> None:
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"count {i}"}],
                max_tokens=5 + i % 7,
                stream=True,
                temperature=0.7,
                seed=i,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            usage = [c.usage for c in stream if c.usage]
            counts.append(usage[-1].completion_tokens - (5 + i % 7))
        except Exception as exc:  # collected, so one failure names itself
            failures.append(f"{i}: {exc!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures and counts == [0] * 32


LONG_STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "go"}],
    "max_tokens": 900,
    "stream": True,
    "ignore_eos": True,
}


def slots_of(http: httpx.Client, owner: str) -> list[dict]:
    return [s for s in http.get("/slots").json()["slots"] if s["owner"] == owner]


def test_disconnect_mid_stream_frees_the_slot(server):
    running, engine = server
    with httpx.Client(base_url=running.url, timeout=30) as http:
        headers = {"X-Lucedesk-Client": "disconnector"}
        with http.stream("POST", "/v1/chat/completions", json=LONG_STREAM, headers=headers) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert slots_of(http, "http:disconnector")
        # Leaving the block closes the connection mid-stream.
        wait_until(lambda: not slots_of(http, "http:disconnector"))
        wait_until(lambda: http.get("/slots").json()["blocks_used"] == 0)
        assert http.get("/slots").json()["pool_basis"] == "set by kv_pool_tokens"


def test_a_client_asks_for_an_interactive_slot_by_header(server, monkeypatch):
    running, engine = server
    execute = engine.seq_engine.execute

    def slowed(plan):  # the stream outlasts the /slots read however busy the machine is
        time.sleep(0.01)
        return execute(plan)

    monkeypatch.setattr(engine.seq_engine, "execute", slowed)
    with httpx.Client(base_url=running.url, timeout=30) as http:
        asks = {"X-Lucedesk-Client": "watched", "X-Lucedesk-Priority": "interactive"}
        with http.stream("POST", "/v1/chat/completions", json=LONG_STREAM, headers=asks) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            assert [s["interactive"] for s in slots_of(http, "http:watched")] == [True]
        bad = http.post(
            "/v1/chat/completions", json=LONG_STREAM, headers={"X-Lucedesk-Priority": "urgent"}
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "X-Lucedesk-Priority"
        assert "interactive or background" in bad.json()["error"]["message"]


def test_owner_label_from_user_agent(server, client):
    running, engine = server
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = iter(stream)
    for _ in range(8):
        next(pieces)
    slots = httpx.get(running.url + "/slots").json()["slots"]
    mine = next(s for s in slots if s["owner"].startswith("http:OpenAI"))
    assert isinstance(mine["tokens_per_s"], float) and "spans" not in mine
    stream.close()


BAD_BODIES = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, "model"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content",
    ),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 7}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": -3}, 400, "top_k"),
]


@pytest.mark.parametrize("body,status,field", BAD_BODIES)
def test_bad_bodies_get_4xx_naming_the_field(server, body, status, field):
    running, engine = server
    r = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == field, error
    assert field in error["message"]
    assert "Traceback" not in r.text
    assert engine.running


def test_malformed_json_and_bad_prompts(server):
    running, engine = server
    r = httpx.post(
        running.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(running.url + "/v1/completions", json={"prompt": [1, 2, 10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = httpx.post(running.url + "/v1/completions", json={"prompt": ""})
    assert r.status_code == 400
    r = httpx.post(running.url + "/v1/completions", json={"prompt": "x" * 9000})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert httpx.get(running.url + "/health").json()["status"] == "ok"


def test_body_size_limit(loaded):
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=1024).start()
    running = start_server(create_app(engine, max_body_bytes=1000), "127.0.0.1", 0)
    try:
        r = httpx.post(running.url + "/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and "larger than 1000 bytes" in r.json()["error"]["message"]
    finally:
        running.stop()
        engine.shutdown()


def test_health_models_metrics(server, client, loaded):
    running, _ = server
    health = httpx.get(running.url + "/health").json()
    assert health["status"] == "ok" and {"active", "queued", "completed"} <= set(health)
    assert [m.id for m in client.models.list()] == [MODEL]
    text = httpx.get(running.url + "/metrics").text
    for name in (
        'lucedesk_requests_total{finish_reason="length"}',
        "lucedesk_time_to_first_token_seconds_bucket",
        "lucedesk_inter_token_latency_seconds_count",
        "lucedesk_kv_blocks_total",
        "lucedesk_kv_blocks_touched",
        "lucedesk_requests_waiting",
        "lucedesk_preemptions_total",
        "lucedesk_generation_tokens_total",
    ):
        assert name in text
    # The values follow the requests: three more of 7 tokens each, cut by length.
    before = metric_values(text)
    for _ in range(3):
        client.completions.create(
            model=MODEL,
            prompt=[5, 6, 7],
            max_tokens=7,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    after = metric_values(httpx.get(running.url + "/metrics").text)
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew['lucedesk_requests_total{finish_reason="length"}'] == 3
    assert grew["lucedesk_generation_tokens_total"] == 21
    assert grew["lucedesk_prompt_tokens_total"] == 9
    assert grew["lucedesk_time_to_first_token_seconds_count"] == 3
    assert grew["lucedesk_inter_token_latency_seconds_count"] == 18
    assert after["lucedesk_requests_running"] == 0
    # The pool's resident part: the blocks ever used, each K and V of every layer (float32).
    c = loaded.config
    block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 16
    assert after["lucedesk_kv_block_bytes"] == block
    assert 1 <= after["lucedesk_kv_blocks_touched"] <= after["lucedesk_kv_blocks_total"]


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text: sample name (with labels) -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_api_key(loaded):
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=1024).start()
    running = start_server(create_app(engine, api_key="s3cret", model_name=MODEL), "127.0.0.1", 0)
    try:
        bad = openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(running.url + "/v1/models").status_code == 401
        good = openai.OpenAI(base_url=running.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list()] == [MODEL]
    finally:
        running.stop()
        engine.shutdown()


def test_a_loopback_server_answers_only_to_its_own_names(server):
    """DNS rebinding: a web page whose domain now resolves to 127.0.0.1 sends its own
    name as Host; every route refuses it (403, in the route's protocol), nothing runs."""
    running, engine = server
    url = running.url
    done = engine.stats().num_completed
    evil = {"Host": "rebound.example:8642"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("GET", "/slots", None),
        ("GET", "/openapi.json", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/api/chat", {"model": MODEL, "messages": chat["messages"]}),
    ]:
        r = httpx.request(method, url + path, json=body, headers=evil, timeout=10)
        assert r.status_code == 403, path
        assert "rebound.example" in json.dumps(r.json()), path
    refused = httpx.post(url + "/v1/messages", json=chat, headers=evil, timeout=10)
    assert refused.json()["error"]["type"] == "permission_error"
    assert engine.stats().num_completed == done
    port = url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200, host


def test_more_host_names_can_be_allowed(loaded):
    engine = make_engine(loaded, max_slots=1, kv_pool_tokens=1024).start()
    app = create_app(engine, model_name=MODEL, allowed_hosts=("127.0.0.1", "box.lan"))
    running = start_server(app, "127.0.0.1", 0)
    try:
        assert httpx.get(running.url + "/v1/models", headers={"Host": "box.lan"}).status_code == 200
        assert httpx.get(running.url + "/v1/models", headers={"Host": "other"}).status_code == 403
    finally:
        running.stop()
        engine.shutdown()


def test_the_key_guards_every_route_before_its_body_is_read(loaded):
    engine = make_engine(loaded, max_slots=1, kv_pool_tokens=1024).start()
    running = start_server(create_app(engine, api_key="s3cret", model_name=MODEL), "127.0.0.1", 0)
    try:
        url, key = running.url, {"Authorization": "Bearer s3cret"}
        assert httpx.get(url + "/openapi.json").status_code == 401
        assert httpx.get(url + "/openapi.json", headers=key).status_code == 200
        garbage = httpx.post(url + "/v1/chat/completions", content=b"{not json")
        assert garbage.status_code == 401  # the key first: no body is parsed for a stranger
        assert httpx.get(url + "/health").status_code == 200
    finally:
        running.stop()
        engine.shutdown()


def test_bodies_are_json_whatever_their_content_type(server):
    """`curl -d` sends form-urlencoded, litellm's ollama_chat sends no JSON type."""
    running, _ = server
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": content_type} if content_type else {}
        for path, body in [
            ("/v1/chat/completions", chat),
            ("/api/chat", {**chat, "stream": False, "options": {"num_predict": 2}}),
        ]:
            r = httpx.post(running.url + path, content=json.dumps(body), headers=headers)
            assert r.status_code == 200, (path, content_type, r.text)


def test_refuses_non_loopback_without_key():
    with pytest.raises(ConfigError, match="without an API key"):
        check_host("0.0.0.0", None)
    check_host("0.0.0.0", "key")
    check_host("127.0.0.1", None)
    check_host("::1", None)


def test_queue_limit_gives_503_and_loses_nothing(loaded):
    engine = make_engine(loaded, max_slots=1, kv_pool_tokens=2048, max_waiting=2).start()
    running = start_server(create_app(engine), "127.0.0.1", 0)
    results: list[tuple[int, dict, dict]] = []

    def one(i: int) -> None:
        body = {"prompt": f"request {i}", "max_tokens": 30, "ignore_eos": True}
        r = httpx.post(running.url + "/v1/completions", json=body, timeout=120)
        results.append((r.status_code, dict(r.headers), r.json()))

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        running.stop()
        engine.shutdown()
    codes = sorted(code for code, _, _ in results)
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
    for code, headers, body in results:
        if code == 503:
            assert headers.get("retry-after") == "1" and "queue is full" in body["error"]["message"]
        else:
            assert body["usage"]["completion_tokens"] == 30


def test_sse_wire_format(server):
    running, _ = server
    body = {**LONG_STREAM, "max_tokens": 3}
    with httpx.stream("POST", running.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
