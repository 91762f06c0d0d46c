"""The real agent CLIs against `lucedesk serve`, headless: Claude Code (Anthropic Messages),
opencode and Qwen Code (OpenAI chat) and Codex (OpenAI Responses), each configured as
docs/api.md says, with the served model's context and an output limit of a quarter of it.

    .venv/bin/python scripts/agent_clis.py [--model gemma3-270m] [--clis DIR] [--short]

The CLIs come from npm (installed into --clis, default ~/.cache/lucedesk/agent-clis, when
missing). A recording proxy between each CLI and the server keeps every request and its
status; per client it reports: every request accepted (2xx), the reply parsed (the CLI
exits 0 and prints an answer), and a tool-call round trip (a later request carries the
result of a call the model made). `--short` gives Claude Code a one-line system prompt and
three tools, for models whose context cannot hold its own (~25k tokens). Not part of
`make test`: it downloads the CLIs and runs each for minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

PACKAGES = {
    "claude": "@anthropic-ai/claude-code",
    "opencode": "opencode-ai",
    "codex": "@openai/codex",
    "qwen": "@qwen-code/qwen-code",
}
NAME = "lucedesk"  # the name the server answers to (--served-model-name)
PROMPT = "Run the shell command `echo lucedesk-ok` and tell me what it printed."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install(clis: Path) -> dict[str, Path]:
    bins = {name: clis / "node_modules" / ".bin" / name for name in PACKAGES}
    if not all(b.exists() for b in bins.values()):
        print(f"installing {', '.join(PACKAGES.values())} into {clis}", flush=True)
        clis.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(clis), *PACKAGES.values()], check=True)
    return bins


class Recorder:
    """A proxy to the server that keeps (path, status, request body) of every request."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: list[tuple[str, int, dict]] = []
        self.client = httpx.AsyncClient(base_url=upstream, timeout=600)

    async def forward(self, request: Request):
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self.client.send(
            self.client.build_request(request.method, url, content=body, headers=headers),
            stream=True,
        )
        try:
            parsed = json.loads(body) if body else {}
        except json.JSONDecodeError:
            parsed = {}
        self.seen.append((request.url.path, upstream.status_code, parsed))

        async def relay():
            async for chunk in upstream.aiter_raw():
                yield chunk
            await upstream.aclose()

        kept = {
            k: v
            for k, v in upstream.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")
        }
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=kept)

    def serve(self, port: int) -> None:
        app = Starlette(
            routes=[Route("/{path:path}", self.forward, methods=["GET", "POST", "HEAD"])]
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        threading.Thread(target=uvicorn.Server(config).run, daemon=True).start()


def answered_a_call(body: dict) -> bool:
    """True for a request that sends back the result of a tool call, in any protocol."""
    items = body.get("messages") or body.get("input") or []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        if item.get("role") == "tool" or item.get("type") == "function_call_output":
            return True
        content = item.get("content")
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in content
        ):
            return True
    return False


def claude_run(bin_: Path, base: str, home: Path, work: Path, short: bool, context: int):
    env = {
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(context // 4),
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_AUTH_TOKEN": "unused",
        **{
            var: NAME
            for var in (
                "ANTHROPIC_MODEL",
                "ANTHROPIC_SMALL_FAST_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_OPUS_MODEL",
                "CLAUDE_CODE_SUBAGENT_MODEL",
            )
        },
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    # Tools allowed up front: headless, nobody answers a permission prompt.
    args = [str(bin_), "-p", PROMPT, "--model", NAME, "--allowedTools", "Bash", "Read", "Edit"]
    if short:
        args += ["--system-prompt", "You are a coding agent. Use tools."]
        args += ["--tools", "Bash,Read,Edit"]
    return args, env


def opencode_run(bin_: Path, base: str, home: Path, work: Path, short: bool, context: int):
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            NAME: {
                "npm": "@ai-sdk/openai-compatible",
                "name": NAME,
                "options": {"baseURL": base + "/v1"},
                "models": {
                    NAME: {"tools": True, "limit": {"context": context, "output": context // 4}}
                },
            }
        },
        "model": f"{NAME}/{NAME}",
        "permission": {"bash": "allow", "edit": "allow"},
    }
    (work / "opencode.json").write_text(json.dumps(config))
    return [str(bin_), "run", "--print-logs", "-m", f"{NAME}/{NAME}", PROMPT], {}


def codex_run(bin_: Path, base: str, home: Path, work: Path, short: bool, context: int):
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{NAME}"\nmodel_provider = "{NAME}"\n'
        f"model_context_window = {context}\n\n"
        f"[model_providers.{NAME}]\n"
        f'name = "{NAME}"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
    )
    args = [
        str(bin_),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        PROMPT,
    ]
    return args, {"CODEX_HOME": str(codex_home)}


def qwen_run(bin_: Path, base: str, home: Path, work: Path, short: bool, context: int):
    env = {"OPENAI_BASE_URL": base + "/v1", "OPENAI_MODEL": NAME}
    return [str(bin_), "-p", PROMPT, "--yolo"], env


RUNS = {"claude": claude_run, "opencode": opencode_run, "codex": codex_run, "qwen": qwen_run}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="what `lucedesk serve --model` takes")
    parser.add_argument("--clis", type=Path, default=Path.home() / ".cache/lucedesk/agent-clis")
    parser.add_argument("--only", choices=list(RUNS), action="append")
    parser.add_argument("--short", action="store_true", help="Claude Code with a short prompt")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    bins = install(args.clis)
    root = Path(tempfile.mkdtemp(prefix="lucedesk-clis-"))
    port = free_port()
    serve = [sys.executable, "-m", "lucedesk", "serve", "--port", str(port)]
    serve += ["--served-model-name", NAME] + (["--model", args.model] if args.model else [])
    log = open(root / "serve.log", "w")
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print((root / "serve.log").read_text())
                return 1
            time.sleep(0.5)
        info = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        print(f"lucedesk serve: {info['id']}, context {info.get('context_length')} tokens")
        rows = []
        for name in args.only or list(RUNS):
            rows.append(run_one(name, bins[name], port, root, args, info["context_length"]))
        print()
        print("| client | requests (2xx / all) | reply parsed | tool-call round trip | note |")
        print("| --- | --- | --- | --- | --- |")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return 0
    finally:
        server.terminate()
        server.wait(30)


def run_one(name: str, bin_: Path, port: int, root: Path, args, context: int) -> list[str]:
    home, work = root / f"{name}-home", root / f"{name}-work"
    home.mkdir()
    work.mkdir()
    recorder = Recorder(f"http://127.0.0.1:{port}")
    proxy_port = free_port()
    recorder.serve(proxy_port)
    time.sleep(0.5)
    base = f"http://127.0.0.1:{proxy_port}"
    argv, env = RUNS[name](bin_, base, home, work, args.short, context)
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), **env}
    env["PWD"] = str(work)  # opencode finds its project (and opencode.json) by PWD
    env.pop("OPENAI_API_KEY", None)
    env["OPENAI_API_KEY"] = "unused"
    print(f"\n== {name}: {' '.join(argv[:2])} ...", flush=True)
    start = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = "timeout", str(exc.stdout or ""), str(exc.stderr or "")
    seconds = time.monotonic() - start
    print(f"exit {code} after {seconds:.0f} s")
    print(f"--- stdout\n{out[-1500:]}\n--- stderr\n{err[-1500:]}")
    generation = [
        (path, status, body)
        for path, status, body in recorder.seen
        if path.endswith(("/messages", "/chat/completions", "/responses"))
    ]
    for path, status, _ in recorder.seen:
        print(f"   {status} {path}")
    ok = sum(200 <= status < 300 for _, status, _ in generation)
    statuses = sorted({status for _, status, _ in generation if status >= 300})
    parsed = "yes" if code == 0 and out.strip() else "no"
    round_trip = "yes" if any(answered_a_call(body) for _, _, body in generation) else "no"
    note = f"{seconds:.0f} s" + (f"; statuses {statuses}" if statuses else "")
    return [name, f"{ok} / {len(generation)}", parsed, round_trip, note]


if __name__ == "__main__":
    if shutil.which("npm") is None:
        sys.exit("npm is needed to install the agent CLIs")
    sys.exit(main())
