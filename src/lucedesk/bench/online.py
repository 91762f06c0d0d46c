"""`lucedesk bench --base-url URL`: a serving benchmark for any OpenAI-compatible server
(lucedesk, llama.cpp's server, vLLM, Ollama). Closed loop at given concurrencies or open
loop with Poisson arrivals at given request rates; streaming requests; a report per level."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from lucedesk.bench.metrics import RequestRecord, Summary, summarize
from lucedesk.errors import ConfigError

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()


@dataclass(slots=True)
class Workload:
    prompts: list[str]
    output_lens: list[int]


def length_range(text: str | int) -> tuple[int, int]:
    """`256` or `32:1024` (lengths drawn uniformly per request)."""
    low, _, high = str(text).partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"length {text!r}: expected N or MIN:MAX") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"length {text!r}: expected 1 <= MIN <= MAX")
    return lo, hi


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def response_format(spec: str | None) -> dict | None:
    """`--response-format`: `json_object`, or a file holding a JSON schema."""
    if not spec:
        return None
    if spec == "json_object":
        return {"type": "json_object"}
    try:
        schema = json.loads(Path(spec).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--response-format {spec}: not a readable JSON schema ({exc})") from None
    return {"type": "json_schema", "json_schema": {"name": Path(spec).stem, "schema": schema}}


def make_workload(args: argparse.Namespace, count: int, seed: int) -> Workload:
    """Prompts of about `input_len` tokens (one common word is about one token), distinct
    per request so no two share a prefix by accident; or a JSONL file; or shared-prefix."""
    rng = random.Random(seed)
    in_lo, in_hi = length_range(args.input_len)
    out_lo, out_hi = length_range(args.output_len)
    outputs = [rng.randint(out_lo, out_hi) for _ in range(count)]
    if args.dataset.startswith("jsonl:"):
        path = Path(args.dataset[6:])
        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            prompts = [r["prompt"] if isinstance(r, dict) else str(r) for r in rows]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(
                f"{path}: expected one JSON object with a 'prompt' per line ({exc})"
            ) from None
        if not prompts:
            raise ConfigError(f"{path}: no prompts")
        return Workload([prompts[i % len(prompts)] for i in range(count)], outputs)
    if args.dataset == "shared-prefix":
        prefix = random_words(rng, args.prefix_len)
        tails = [max(rng.randint(in_lo, in_hi) - args.prefix_len, 1) for _ in range(count)]
        prompts = [f"{prefix} {i}: {random_words(rng, t)}" for i, t in enumerate(tails)]
        return Workload(prompts, outputs)
    if args.dataset != "random":
        raise ConfigError(f"--dataset {args.dataset!r}: random, shared-prefix or jsonl:PATH")
    lengths = [rng.randint(in_lo, in_hi) for _ in range(count)]
    return Workload([f"{i}: {random_words(rng, n)}" for i, n in enumerate(lengths)], outputs)


class Client:
    def __init__(
        self,
        base_url: str,
        model: str | None,
        api_key: str | None,
        response_format: dict | None = None,
    ) -> None:
        self.response_format = response_format
        self.base = base_url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        headers = {"X-Lucedesk-Client": "lucedesk-bench"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(600, connect=10),
            # A new connection per request: some servers (llama.cpp's) close one after each
            # streamed reply, and a pooled connection reused as it closes fails the request.
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=0),
        )
        self.model = model

    async def resolve_model(self) -> str:
        if self.model:
            return self.model
        try:
            r = await self.http.get(self.base + "/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"{self.base}/models: cannot list the server's models ({exc}); pass --model"
            ) from None
        return self.model

    async def request(self, prompt: str, output_len: int) -> RequestRecord:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        if self.response_format is not None:
            body["response_format"] = self.response_format
        rec = RequestRecord(time.perf_counter(), expected_output_tokens=output_len)
        try:
            async with self.http.stream("POST", self.base + "/completions", json=body) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    now = time.perf_counter()
                    if event.get("choices") and event["choices"][0].get("text"):
                        rec.token_times.append(now)
                    usage = event.get("usage")
                    if usage:
                        rec.num_prompt_tokens = usage.get("prompt_tokens", 0)
                        rec.num_output_tokens = usage.get("completion_tokens", 0)
        except (httpx.HTTPError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        if not rec.num_output_tokens:
            rec.num_output_tokens = len(rec.token_times)  # a server that sends no usage
        return rec

    async def close(self) -> None:
        await self.http.aclose()


class Progress:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0

    def tick(self) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        sys.stderr.write(
            f"\r{self.label:<14} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def closed_loop(
    client: Client, work: Workload, concurrency: int, progress: Progress
) -> tuple[list[RequestRecord], float]:
    queue = list(zip(work.prompts, work.output_lens))
    records: list[RequestRecord] = []

    async def worker() -> None:
        while queue:
            prompt, output_len = queue.pop(0)
            rec = await client.request(prompt, output_len)
            records.append(rec)
            progress.tick()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


async def open_loop(
    client: Client, work: Workload, rate: float, seed: int, progress: Progress
) -> tuple[list[RequestRecord], float]:
    """Poisson arrivals at `rate` requests per second, whatever the server's pace."""
    rng = random.Random(seed)

    async def one(prompt: str, output_len: int) -> RequestRecord:
        rec = await client.request(prompt, output_len)
        progress.tick()
        return rec

    start = time.perf_counter()
    tasks = []
    for prompt, output_len in zip(work.prompts, work.output_lens):
        tasks.append(asyncio.create_task(one(prompt, output_len)))
        await asyncio.sleep(rng.expovariate(rate))
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - start


async def run_levels(args: argparse.Namespace, base_url: str) -> dict:
    fmt = response_format(getattr(args, "response_format", None))
    client = Client(base_url, args.model, args.api_key or os.environ.get("LUCEDESK_API_KEY"), fmt)
    try:
        model = await client.resolve_model()
        warm = make_workload(args, args.warmup, args.seed + 10_000)
        if args.warmup:
            await closed_loop(
                client,
                Workload(warm.prompts, [min(n, 16) for n in warm.output_lens]),
                min(args.warmup, 4),
                Progress("warm-up", args.warmup),
            )
        levels = []
        for kind, values in (("concurrency", args.levels), ("rate", args.rates)):
            for value in values:
                work = make_workload(args, args.num_requests, args.seed + len(levels))
                progress = Progress(f"{kind} {value:g}", len(work.prompts))
                if kind == "concurrency":
                    records, wall = await closed_loop(client, work, int(value), progress)
                else:
                    records, wall = await open_loop(client, work, value, args.seed, progress)
                summary = summarize(records, wall, args.slo_ttft, args.slo_tpot)
                levels.append({"kind": kind, "value": value, **summary.as_dict()})
    finally:
        await client.close()
    return {
        "server": base_url,
        "model": model,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "settings": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_requests": args.num_requests,
            "dataset": args.dataset,
            "warmup": args.warmup,
            "slo_ttft": args.slo_ttft,
            "slo_tpot": args.slo_tpot,
            "response_format": fmt,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "levels": levels,
    }


def markdown(result: dict) -> str:
    lines = [
        f"{result['server']} · {result['model']}",
        "",
        "| level | output tok/s | req/s | TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) "
        "| ITL p50/p99 (ms) | max ITL (ms) | goodput (req/s) | failed | short |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        s = Summary(**{k: lv[k] for k in Summary.__slots__})
        label = f"C={lv['value']:g}" if lv["kind"] == "concurrency" else f"{lv['value']:g} req/s"
        good = "" if s.goodput_requests_s is None else f"{s.goodput_requests_s:.2f}"
        lines.append(
            f"| {label} | {s.output_tok_s:.1f} | {s.requests_s:.2f} | {s.ttft_p50 * 1e3:.0f} / "
            f"{s.ttft_p90 * 1e3:.0f} / {s.ttft_p99 * 1e3:.0f} | {s.tpot_p50 * 1e3:.1f} / "
            f"{s.tpot_p90 * 1e3:.1f} / {s.tpot_p99 * 1e3:.1f} | {s.itl_p50 * 1e3:.1f} / "
            f"{s.itl_p99 * 1e3:.1f} | {s.max_itl * 1e3:.0f} | {good} | {s.num_failed} "
            f"| {s.length_mismatches} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Output tok/s against TTFT p99, one line per result (server or setting)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        pts = [(lv["ttft_p99"] * 1e3, lv["output_tok_s"]) for lv in r["levels"]]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            label=f"{r['model']} @ {r['server']}",
        )
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if not args.base_url and not args.compare:
        raise ConfigError(
            "give --base-url URL (an OpenAI-compatible server), --compare URL "
            "URL ..., or --offline for the in-process engine"
        )
    concurrency = args.concurrency or ("" if args.request_rate else "1,2,4,8,16")
    try:
        args.levels = [float(c) for c in concurrency.split(",") if c.strip()]
        args.rates = [float(r) for r in (args.request_rate or "").split(",") if r.strip()]
    except ValueError:
        raise ConfigError("--concurrency and --request-rate take numbers like 1,2,4") from None
    urls = args.compare or [args.base_url]
    results = [asyncio.run(run_levels(args, url)) for url in urls]
    for result in results:
        print(markdown(result) + "\n")
    if args.json:
        files = (
            [args.json]
            if len(results) == 1
            else [f"{Path(args.json).with_suffix('')}-{i}.json" for i in range(len(results))]
        )
        for result, name in zip(results, files):
            Path(name).write_text(json.dumps(result, indent=2))
    if len(results) > 1:
        print(ratios(results))
    if args.plot:
        extra = [json.loads(Path(p).read_text()) for p in args.plot_with]
        plot(results + extra, args.plot)
    return 0


def ratios(results: list[dict]) -> str:
    base = results[0]
    lines = [
        "| level | " + " | ".join(r["server"] for r in results[1:]) + " |",
        "|---|" + "---:|" * (len(results) - 1),
    ]
    for i, lv in enumerate(base["levels"]):
        cells = []
        for r in results[1:]:
            other = r["levels"][i]
            tps = other["output_tok_s"] / lv["output_tok_s"] if lv["output_tok_s"] else 0
            ttft = other["ttft_p50"] / lv["ttft_p50"] if lv["ttft_p50"] else 0
            cells.append(f"{tps:.2f}x tok/s, {ttft:.2f}x TTFT p50")
        lines.append(f"| {lv['kind']} {lv['value']:g} | " + " | ".join(cells) + " |")
    return f"ratios against {base['server']}:\n" + "\n".join(lines)
