"""What users hit when things go wrong: a generation that fails (HTTP 500, an error event in
a stream), a client that leaves a non-streamed request, `lucedesk serve` as a process with
an API key, and a port already in use."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.server import create_app, start_server
from tests.conftest import free_port, wait_until
from tests.engine_harness import make_engine

POISON = {"X-Lucedesk-Client": "poison"}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = make_engine(load_model(tiny_llama, torch.float32), max_slots=4, kv_pool_tokens=8192)
    runner = engine.seq_engine
    real_execute = runner.execute

    def faulty(plan):  # any step holding a request from the "poison" client fails
        if any(r.request.owner == "http:poison" for r in plan.rows):
            raise RuntimeError("injected fault")
        time.sleep(0.005)  # a 900-token reply takes seconds: long enough to walk away from
        return real_execute(plan)

    runner.execute = faulty
    engine.start()
    running = start_server(create_app(engine), "127.0.0.1", 0)
    yield running.url, engine
    running.stop()
    engine.shutdown()


def test_a_failed_generation_is_a_500_and_the_server_goes_on(server):
    url, engine = server
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=POISON, timeout=30)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    assert "Traceback" not in r.text
    ok = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert ok.status_code == 200
    r = httpx.post(url + "/v1/messages", json=CHAT, headers=POISON, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    wait_until(lambda: engine.stats().num_running == 0 and engine.stats().blocks_used == 0)


def test_a_failed_generation_ends_a_stream_with_an_error_event(server):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=POISON)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    r = httpx.post(url + "/v1/messages", json={**CHAT, "stream": True}, headers=POISON)
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "error"
    r = httpx.post(url + "/api/chat", json=CHAT | {"stream": True}, headers=POISON)
    last = json.loads(r.text.splitlines()[-1])
    assert "injected fault" in last["error"]


def test_a_client_leaving_a_non_streamed_request_frees_its_slot(server):
    url, engine = server
    body = {**CHAT, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    left = time.monotonic()
    wait_until(lambda: engine.stats().num_running == 0, 5)
    assert time.monotonic() - left < 2.0  # noticed at the next half-second poll
    assert engine.stats().num_completed >= 1


def serve_process(model, port: int, env: dict, extra: list[str] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lucedesk",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--set",
            "kernels=torch",
            "--set",
            "weights=dtype",
            "--set",
            "max_slots=2",
            "--set",
            "kv_pool_tokens=2048",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_serve_process_with_an_api_key_from_the_environment(tiny_llama):
    port = free_port()
    proc = serve_process(tiny_llama, port, {**os.environ, "LUCEDESK_API_KEY": "sekrit"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url), 60, 0.2)
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=wrong).status_code == 401
        good = {"Authorization": "Bearer sekrit"}
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=good, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_port_in_use_is_a_clear_error(tiny_llama):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = serve_process(tiny_llama, port, dict(os.environ))
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode not in (0, None)
    assert f"cannot listen on 127.0.0.1:{port}" in stderr
    assert "Traceback" not in stderr


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
