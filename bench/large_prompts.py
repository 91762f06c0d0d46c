"""Resident memory of `lucedesk serve` over prompts too long for the context (each refused
with a 400 after it is tokenized): ready, the highest seen between rounds, and after.

    .venv/bin/python bench/large_prompts.py [--model NAME] [--rounds 4] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import subprocess
import sys
import time

import httpx


def rss_mb(pid: int) -> int:
    return rss_parts_mb(pid)["VmRSS"]


def rss_parts_mb(pid: int) -> dict[str, int]:
    """A process's resident memory, MiB: all of it (VmRSS) and its parts, anonymous
    (RssAnon: heaps, the KV pool's touched pages) and file-backed (RssFile: mapped weights,
    libraries)."""
    parts = {}
    for line in open(f"/proc/{pid}/status"):
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            parts[key] = int(line.split()[1]) // 1024
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--chars", type=int, default=3_900_000)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    sets = ["--set", "max_slots=4", "--set", "kv_pool_tokens=16384"]
    command = [sys.executable, "-m", "lucedesk", "serve", "--model", args.model, *sets]
    server = subprocess.Popen(
        [*command, "--port", str(args.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{args.port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        ready = rss_mb(server.pid)
        rng = random.Random(0)
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(5000)]
        texts = [
            " ".join(rng.choices(words, k=args.chars // 5))[: args.chars]
            for _ in range(args.concurrency)
        ]

        def send(text: str) -> int:
            body = {"model": "default", "max_tokens": 5}
            body["messages"] = [{"role": "user", "content": text}]
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=600).status_code

        highest = ready
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            for _ in range(args.rounds):
                codes = list(pool.map(send, texts))
                assert set(codes) == {400}, codes
                highest = max(highest, rss_mb(server.pid))
        time.sleep(2)
        after = rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(30)
    print(
        f"{args.rounds} rounds of {args.concurrency} prompts of {args.chars:,} characters: "
        f"RSS ready {ready} MB, highest after a round {highest} MB, after {after} MB"
    )


if __name__ == "__main__":
    main()
