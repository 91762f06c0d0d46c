"""What a web page and a strange request cannot do: a foreign Origin is refused on every route
(a page could otherwise drive the server with a request a browser sends unasked), allowed
origins get their CORS preflights, the Host header is parsed strictly; and a schema the
grammar library cannot serve is a 400 naming its field in every protocol."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.server import create_app, start_server
from tests.engine_harness import make_engine

CHAT = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
ROUTES = [  # one of each family: the engine's own, OpenAI, Responses, Anthropic, Ollama, utilities
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("GET", "/slots", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/responses", {"model": "default", "input": "hi", "max_output_tokens": 16}),
    ("POST", "/v1/messages", CHAT),
    ("POST", "/api/chat", {**CHAT, "stream": False}),
    ("POST", "/tokenize", {"model": "default", "prompt": "hi"}),
]
FOREIGN = ["http://evil.example", "https://evil.example:8443", "null", "http://127.0.0.1.evil.io"]
# required at every depth: no finite value satisfies it
ENDLESS = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = make_engine(load_model(tiny_llama, torch.float32), max_slots=2, kv_pool_tokens=4096)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    running = start_server(
        create_app(engine, allowed_origins=("https://ui.example", "https://*.lan.example")),
        "127.0.0.1",
        0,
    )
    yield running.url
    running.stop()


def test_a_foreign_origin_is_refused_on_every_route_and_nothing_runs(url, engine):
    done = engine.stats().num_completed
    for origin in FOREIGN:
        for method, path, body in ROUTES:
            # text/plain: the type a page may post without a preflight
            r = httpx.request(
                method,
                url + path,
                content=json.dumps(body) if body else None,
                headers={"Origin": origin, "Content-Type": "text/plain"},
                timeout=30,
            )
            assert r.status_code == 403, (origin, path, r.text)
            assert "origin" in r.text and "--allow-origin" in r.text
            assert "access-control-allow-origin" not in r.headers
    assert engine.stats().num_completed == done
    refused = httpx.post(url + "/v1/messages", json=CHAT, headers={"Origin": FOREIGN[0]})
    assert refused.json()["error"]["type"] == "permission_error"  # in the route's protocol


def test_this_machines_pages_and_allowed_origins_are_served_with_cors(url):
    port = url.rsplit(":", 1)[1]
    for origin in (f"http://localhost:{port}", "http://127.0.0.1:3000", "https://ui.example"):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert r.status_code == 200, origin
        assert r.headers["access-control-allow-origin"] == origin
        pre = httpx.options(
            url + "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, authorization",
            },
        )
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == origin
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert pre.headers["access-control-allow-headers"] == "content-type, authorization"
    assert httpx.get(url + "/v1/models", headers={"Origin": "https://box.lan.example"}).is_success
    pre = httpx.options(
        url + "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200  # no Origin


def test_a_host_header_is_parsed_strictly(url):
    port = url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}@evil.example", "[::1]evil.example", "localhost:80:80", ""):
        r = httpx.get(url + "/v1/models", headers={"Host": host})
        assert r.status_code == 403, host
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LocalHost"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200, host


def test_a_schema_no_value_can_satisfy_is_a_400_naming_its_field(url, engine):
    tool = {"type": "function", "function": {"name": "f", "parameters": ENDLESS}}
    cases = [
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": ENDLESS},
                },
            },
            "response_format",
        ),
        ("/v1/chat/completions", {**CHAT, "tools": [tool], "tool_choice": "required"}, "tools"),
        (
            "/v1/messages",
            {
                **CHAT,
                "tools": [{"name": "f", "input_schema": ENDLESS}],
                "tool_choice": {"type": "any"},
            },
            "tools",
        ),
        ("/api/chat", {**CHAT, "stream": False, "format": ENDLESS}, "format"),
    ]
    for path, body, field in cases:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert field in r.text, (path, r.text)
        assert "<state>" not in r.text and "Tokens:" not in r.text
    assert engine.stats().num_running == 0
