"""The access log: `lucedesk serve` prints one line per request (method, path, status,
client, tokens, time to first token, duration; a 4xx or 5xx with its message), as text or
JSON; the TUI keeps the same lines in its log view (F9)."""

from __future__ import annotations

import json
import os

import httpx

from tests.conftest import free_port, wait_until
from tests.test_server_failures import serve_process

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TOO_LONG = {**CHAT, "messages": [{"role": "user", "content": "word " * 3000}]}


def requests_to(url: str) -> None:
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    headers = {"User-Agent": "claude-cli/2.1 (external)"}
    assert httpx.post(url + "/v1/messages", json=TOO_LONG, headers=headers).status_code == 400
    evil = {"Origin": "http://evil.example"}
    assert httpx.get(url + "/v1/models", headers=evil).status_code == 403
    assert httpx.get(url + "/v1/nothing").status_code == 404


def served_lines(tiny_llama, *extra: str) -> list[str]:
    port = free_port()
    proc = serve_process(tiny_llama, port, dict(os.environ), list(extra))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: up(url), 60, 0.2)
        requests_to(url)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    return stderr.splitlines()


def up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_prints_a_line_per_request(tiny_llama):
    lines = [line for line in served_lines(tiny_llama) if " /health " not in line]
    chat = next(line for line in lines if "POST /v1/chat/completions 200 127.0.0.1:" in line)
    assert "http:python-httpx/" in chat and "prompt=" in chat and "output=3" in chat
    assert "ttft=" in chat
    refused = next(line for line in lines if "POST /v1/messages 400" in line)
    assert "http:claude-cli/2.1" in refused and "prompt is too long: " in refused
    assert any("GET /v1/models 403" in line and "evil.example" in line for line in lines)
    assert any("GET /v1/nothing 404" in line for line in lines)


def test_serve_prints_json_lines_when_asked(tiny_llama):
    records = []
    for line in served_lines(tiny_llama, "--log-format", "json"):
        if line.startswith("{"):
            records.append(json.loads(line))
    chat = next(r for r in records if r.get("path") == "/v1/chat/completions")
    assert chat["status"] == 200 and chat["output_tokens"] == 3 and chat["prompt_tokens"] > 0
    assert isinstance(chat["ttft_s"], float) and isinstance(chat["duration_s"], float)
    assert chat["client"].startswith("127.0.0.1:") and chat["error"] is None
    refused = next(r for r in records if r.get("path") == "/v1/messages")
    assert refused["status"] == 400 and "prompt is too long" in refused["error"]


def test_a_start_says_what_it_does_with_its_time_so_far():
    import time

    from lucedesk.server.startup import Startup

    said: list[str] = []
    startup = Startup(said.append, every=0.05)
    startup.stage("building the CPU kernels")
    time.sleep(0.2)
    assert startup.describe().startswith("building the CPU kernels (")
    startup.done()
    assert said[0] == "building the CPU kernels"
    assert any(
        line.startswith("building the CPU kernels: ") and "s so far" in line for line in said
    )


def test_serve_listens_first_and_health_says_starting_until_the_model_serves(
    default_model, tmp_path
):
    import subprocess
    import sys

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lucedesk", "serve", "--model", str(default_model)]
            + ["--port", str(port), "--set", "max_slots=2"],  # a derived pool: seconds to zero
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    url = f"http://127.0.0.1:{port}"
    answers = []
    try:

        def ready() -> bool:
            try:
                r = httpx.get(url + "/health", timeout=2)
            except httpx.HTTPError:
                return False
            answers.append((r.status_code, r.json()))
            return r.status_code == 200

        wait_until(ready, 120, 0.02)
        chat = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert chat.status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0
    assert answers[0][0] == 503 and answers[0][1]["status"] == "starting"
    said = [body["message"] for status, body in answers if status == 503]
    assert any(m.startswith(f"starting: loading {default_model.name}") for m in said), said
    assert f"lucedesk: loading {default_model.name}" in log.read_text()


def resident_bytes(pid: int, part: str = "VmRSS") -> int:
    """A process's resident memory: all of it, or a part ("RssFile": mapped files, the
    held weights and libraries)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(part + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(part)


def not_file_backed(pid: int) -> int:
    """Resident memory no file backs: heaps, the KV pool's touched pages (anonymous or
    shared)."""
    return resident_bytes(pid) - resident_bytes(pid, "RssFile")


def test_memory_a_refused_long_prompt_took_goes_back(default_model, tmp_path):
    """Four 3.9 MB prompts (each tokenized, then refused) left the server 0.8 GB larger for
    good: freed memory stayed in the C heap's arenas. A measure of what a request leaves,
    not of time."""
    import concurrent.futures
    import random
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lucedesk", "serve", "--model", str(default_model)]
        + ["--port", str(port), "--set", "max_slots=2", "--set", "kv_pool_tokens=4096"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def refused(text: str) -> int:
        body = {**CHAT, "messages": [{"role": "user", "content": text}]}
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=300).status_code

    rng = random.Random(0)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    texts = [" ".join(rng.choices(words, k=780_000))[:3_900_000] for _ in range(2)]
    try:
        wait_until(lambda: up(url), 120, 0.2)
        ready = resident_bytes(proc.pid)
        for _ in range(2):
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                codes = list(pool.map(refused, texts))
            assert codes == [400, 400]
        # before: +790 MB, kept
        wait_until(lambda: resident_bytes(proc.pid) - ready < 400 << 20, 10, 0.5)
    finally:
        proc.terminate()
        proc.wait(30)


def test_resident_memory_grows_with_the_kv_blocks_used(default_model):
    """The KV pool is reserved, not written: at ready none of its 2.8 GB is resident, and
    afterwards what the process's memory no file backs grew by is the blocks ever used plus
    at most the activation reserve the fit check counts (held weights are mapped from their
    cache file: they come in as file pages on first use). Before: freed blank blocks were
    handed out first in, first out, so twelve requests one after another touched twelve
    requests' blocks; and the first token written made a 2 MiB huge page resident per KV
    head, layer, K and V (+300 MB for 7 MB of blocks). A measure of memory, not of time."""
    import random
    import subprocess
    import sys

    port = free_port()
    reserve_mb = 128
    proc = subprocess.Popen(
        [sys.executable, "-m", "lucedesk", "serve", "--model", str(default_model)]
        + ["--port", str(port), "--set", "max_slots=2", "--set", "kv_pool_tokens=131072"]
        + ["--set", "prefix_cache=false", "--set", f"activation_reserve_mb={reserve_mb}"]
        + ["--no-disk-cache"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    rng = random.Random(1)
    try:
        wait_until(lambda: up(url), 120, 0.2)
        pool = httpx.get(url + "/slots").json()
        pool_bytes = pool["blocks_total"] * pool["kv_block_bytes"]
        assert pool["blocks_touched"] == 0 and pool_bytes > 2 << 30
        ready = not_file_backed(proc.pid)
        assert ready < pool_bytes / 2
        for _ in range(12):
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(300))
            body = {**CHAT, "messages": [{"role": "user", "content": words}], "max_tokens": 8}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200
        pool = httpx.get(url + "/slots").json()
        one = -(-(300 + 40) // pool["block_size"])  # a request's blocks, its template included
        assert 0 < pool["blocks_touched"] <= 2 * one  # twelve in turn: one's blocks, used again
        kv = pool["blocks_touched"] * pool["kv_block_bytes"]
        assert not_file_backed(proc.pid) - ready <= kv + (reserve_mb << 20)
    finally:
        proc.terminate()
        proc.wait(30)
