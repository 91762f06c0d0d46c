"""llama.cpp's `llama-server` beside `lucedesk serve` on the same GGUF, measured by lucedesk's own
benchmark client in the order A B B A (lucedesk, llama.cpp, then llama.cpp, lucedesk), so drift
in the machine's speed falls on both alike; the second pair runs on prompts of its own.

    .venv/bin/python bench/llama_cpp_peer.py [--model PATH] [--write-docs] [-- BENCH ARGS]

Everything after `--` goes to `lucedesk bench` (e.g. `-- --dataset jsonl:PATH`); -n, -c,
--input-len and --output-len default to `-n 16 -c 1,4,16 --input-len 256 --output-len 128`
unless given there. `llama-server` is `--llama-server PATH`, else the one on PATH, else a build
cached under the user cache folder, else built once from the llama.cpp that the pinned
llama-cpp-python sdist vendors (fetched with pip; about ten minutes on two cores).
Each cell of the table is the median of the two runs per server; a ratio is lucedesk over
llama.cpp. `--write-docs` puts the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from llama_cpp_build import (  # noqa: F401 (moe_peer reaches them here too)
    TOOLS,
    cache_dir,
    describe_llama_server,
    find_llama_server,
    find_llama_tools,
    say,
)

from lucedesk.catalog.resolve import resolve
from lucedesk.isa import cpu_flags

BENCH_DEFAULTS = {
    ("-n", "--num-requests"): "16",
    ("-c", "--concurrency"): "1,4,16",
    ("--input-len",): "256",
    ("--output-len",): "128",
}
# Set by this script; bench's --model is the name it sends, which is this script's --name.
OWN_BENCH_OPTIONS = frozenset(
    "--base-url --compare --json --plot --plot-with --offline --model -m".split()
)
# The numbers compared: (key in a level's results, scale to the unit shown, digits shown).
COMPARED = (("output_tok_s", 1, 1), ("ttft_p50", 1e3, 0), ("tpot_p50", 1e3, 1))
DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SECTION = "## Against llama.cpp's server"


@dataclass(slots=True)
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> Callable[[], object] | None:
    """A preexec_fn for Popen: the child gets SIGTERM when this script dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG; elsewhere nothing). libc is loaded here, before the fork."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)


def start_server(name: str, cmd: list[str], port: int, log_dir: Path) -> Server:
    """Start `cmd` in its own process group (so stopping it takes its children too, and the
    terminal's Ctrl-C reaches only this script, which then stops it)."""
    log = log_dir / f"{name}.log"
    say(f"starting {name}: {shlex.join(cmd)} (log: {log})")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
    return Server(name, f"http://127.0.0.1:{port}", proc, log)


def wait_healthy(server: Server, timeout: float = 600, every: float = 0.5) -> None:
    """Poll `/health` every `every` seconds until it answers 200 with status ok
    (llama-server answers 503 while it loads); fail early, with the log's tail, if the
    process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = "\n".join(server.log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"{server.name} exited with {server.proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(server.url + "/health", timeout=5)
            if r.status_code == 200 and r.json().get("status") == "ok":
                say(f"{server.name} is ready at {server.url}")
                return
        time.sleep(every)
    raise SystemExit(f"{server.name} did not become healthy in {timeout:.0f} s")


def stop_server(server: Server) -> None:
    """SIGTERM to the whole process group, SIGKILL if it has not exited after 15 s."""
    if server.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    say(f"{server.name} stopped")


def llama_server_cmd(
    binary: Path, model: Path, port: int, name: str, args: argparse.Namespace
) -> list[str]:
    """`--parallel` slots of `--slot-ctx` tokens each; `--cont-batching` where it is a flag
    (it is the default in recent versions)."""
    cmd = [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--alias", name, "--parallel", str(args.slots), "--threads", str(args.threads)]
    cmd += ["--ctx-size", str(args.slots * args.slot_ctx)]
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    if "--cont-batching" in help_text:
        cmd.append("--cont-batching")
    return cmd


def lucedesk_cmd(model: Path, port: int, name: str, settings: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "lucedesk", "serve", "--model", str(model), "--port", str(port)]
    cmd += [arg for setting in settings for arg in ("--set", setting)]
    return cmd + ["--served-model-name", name]


def option_name(arg: str) -> str:
    """`--input-len=64` -> `--input-len`, `-c1,4` -> `-c`."""
    return arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]


def bench_args(passthrough: list[str]) -> list[str]:
    """The user's `lucedesk bench` arguments with the defaults for what they leave out."""
    given = {option_name(a) for a in passthrough if a.startswith("-")}
    clash = given & OWN_BENCH_OPTIONS
    if clash:
        raise SystemExit(f"{', '.join(sorted(clash))}: set by this script, not passed through")
    args = list(passthrough)
    for names, value in BENCH_DEFAULTS.items():
        open_loop = "--concurrency" in names and "--request-rate" in given
        if not given & set(names) and not open_loop:
            args += [names[0], value]
    return args


def with_seed(args: list[str], offset: int) -> list[str]:
    """`args` with `--seed` (0 if not given) moved on by `offset`. A bench run's levels take
    seeds SEED, SEED+1, ... and its warm-up SEED+10000, so an offset of 100 gives the second
    pair of runs prompts of its own: neither server finds them in its prompt cache."""
    seed, rest, i = 0, [], 0
    while i < len(args):
        if args[i] == "--seed" and i + 1 < len(args):
            seed, i = int(args[i + 1]), i + 2
        elif args[i].startswith("--seed="):
            seed, i = int(args[i].split("=", 1)[1]), i + 1
        else:
            rest.append(args[i])
            i += 1
    return [*rest, "--seed", str(seed + offset)]


def run_compare(first: Server, second: Server, args: list[str], out: Path) -> list[dict]:
    """One `lucedesk bench --compare FIRST SECOND`; its tables go to stderr, its results
    (written as OUT-0.json, OUT-1.json) come back in that order."""
    say(f"measuring {first.name}, then {second.name}")
    cmd = [sys.executable, "-m", "lucedesk", "bench", "--compare", first.url, second.url]
    done = subprocess.run([*cmd, *args, "--json", str(out)], stdout=sys.stderr)
    if done.returncode != 0:
        raise SystemExit(f"lucedesk bench failed (exit {done.returncode})")
    stem = out.with_suffix("")
    return [json.loads(Path(f"{stem}-{i}.json").read_text()) for i in range(2)]


def abba(lucedesk: Server, llama: Server, args: list[str], tmp: Path) -> dict[str, list[dict]]:
    """Both orders, so each server is measured once early and once late; the second pair on
    fresh prompts (see `with_seed`)."""
    runs: dict[str, list[dict]] = {lucedesk.name: [], llama.name: []}
    for i, pair in enumerate([(lucedesk, llama), (llama, lucedesk)]):
        results = run_compare(*pair, with_seed(args, 100 * i), tmp / f"run{i}.json")
        for server, result in zip(pair, results):
            runs[server.name].append(result)
    return runs


def median_levels(results: list[dict]) -> list[dict]:
    """Per level, the median over runs of each number (runs share their levels)."""
    levels = []
    for per_run in zip(*(r["levels"] for r in results)):
        level = {"kind": per_run[0]["kind"], "value": per_run[0]["value"]}
        for key, _, _ in COMPARED:
            level[key] = statistics.median(lv[key] for lv in per_run)
        for key in ("num_failed", "length_mismatches"):
            level[key] = sum(lv[key] for lv in per_run)
        levels.append(level)
    return levels


def level_label(level: dict) -> str:
    return (
        f"C={level['value']:g}" if level["kind"] == "concurrency" else f"{level['value']:g} req/s"
    )


def disagreements(runs: dict[str, list[dict]], tolerance: float = 0.25) -> list[str]:
    """Levels where one server's runs differ in output tok/s by more than `tolerance`: something
    else was using the machine meanwhile, and the medians say little."""
    notes = []
    for name, results in runs.items():
        for per_run in zip(*(r["levels"] for r in results)):
            speeds = [lv["output_tok_s"] for lv in per_run]
            if min(speeds) < (1 - tolerance) * max(speeds):
                shown = ", ".join(f"{v:.1f}" for v in speeds)
                notes.append(f"{name} at {level_label(per_run[0])}: runs gave {shown} tok/s")
    return notes


def table(ours: list[dict], theirs: list[dict]) -> str:
    """Medians side by side and the ratio lucedesk / llama.cpp; failed and short requests
    (fewer or more output tokens than asked) summed over both runs."""
    lines = [
        "| level | output tok/s lucedesk / llama.cpp | ratio | TTFT p50 (ms) lucedesk / llama.cpp "
        "| ratio | TPOT p50 (ms) lucedesk / llama.cpp | ratio | failed | short |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(ours, theirs):
        cells = [level_label(a)]
        for key, scale, digits in COMPARED:
            x, y = a[key] * scale, b[key] * scale
            cells += [f"{x:.{digits}f} / {y:.{digits}f}", f"{x / y:.2f}x" if y else "-"]
        cells.append(f"{a['num_failed']} / {b['num_failed']}")
        cells.append(f"{a['length_mismatches']} / {b['length_mismatches']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


ABOUT = """\
`bench/llama_cpp_peer.py` starts llama.cpp's `llama-server` and `lucedesk serve` (the detected
profile) on the same GGUF and measures both with `lucedesk bench --compare` twice, in the order
lucedesk, llama.cpp, then llama.cpp, lucedesk, the second pair on prompts of its own (`--seed`
+ 100) so that neither server finds them in its prompt cache. Each cell is the median of a
server's two runs; a ratio is lucedesk / llama.cpp (above 1 is better for tok/s, below 1 for
TTFT and TPOT); failed and short (fewer or more output tokens than asked) are summed over both
runs, lucedesk / llama.cpp."""


# The CPU features that choose the kernels' paths (cpu_build.py, held weights).
CPU_PATHS = (("avx512_vnni", "AVX512-VNNI"), ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))


def machine() -> str:
    """The CPU a run measured on ("2 CPUs, Intel(R) Xeon(R) Processor (AVX512-VNNI, AMX)"):
    one machine's numbers are not another's, and more than one kind runs this bench."""
    name = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
                break
    flags = cpu_flags().split()
    paths = [label for flag, label in CPU_PATHS if flag in flags]
    return f"{os.cpu_count()} CPUs, {name or 'model unknown'}" + (
        f" ({', '.join(paths)})" if paths else ""
    )


def docs_section(
    report: str, command: str, llama: dict, server_cmd: list[str], heading: str = SECTION
) -> str:
    """The docs section: what was run, on what, when, and the table."""
    run_flags = shlex.join(server_cmd[server_cmd.index("--parallel") :])
    if "cmake_flags" in llama:
        cmake = textwrap.fill(
            shlex.join(["cmake", "-G", "Ninja", *llama["cmake_flags"]]),
            width=96,
            break_on_hyphens=False,
            subsequent_indent="    ",
        ).replace("\n", " \\\n")
        build = (
            f"llama.cpp {llama['llama_cpp_commit'][:9]}, the copy vendored by llama-cpp-python "
            f"{llama['llama_cpp_python']} (it reports `{llama['version']}`), built with\n\n"
            f"```sh\n{cmake}\ncmake --build build --target {' '.join(TOOLS)}\n```\n\n"
            f"and run as `llama-server ... {run_flags}`."
        )
    else:
        build = (
            f"`llama-server` given on the command line (it reports `{llama['version']}`; build "
            f"flags unknown), run as `llama-server ... {run_flags}`."
        )
    return (
        f"{heading}\n\n{ABOUT}\n\n```sh\n{command}\n```\n\n{build} "
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}.\n\n{report}\n"
    )


def replace_section(text: str, section: str) -> str:
    """`section` in place of the one with the same heading (up to the next `## `), or appended
    at the end."""
    lines = text.splitlines(keepends=True)
    heading = section.splitlines()[0]
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip() == heading)
    except StopIteration:
        return text.rstrip("\n") + "\n\n" + section
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    rest = "".join(lines[end:])
    return "".join(lines[:start]) + section + ("\n" + rest if rest else "")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    mine, passthrough = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        usage="%(prog)s [options] [-- LUCEDESK BENCH ARGS]",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--llama-server", default=None, help="use this llama-server binary")
    parser.add_argument("--name", default=None, help="model name both servers answer to")
    parser.add_argument("--slots", type=int, default=16, help="llama-server --parallel")
    parser.add_argument("--threads", type=int, default=2, help="llama-server --threads")
    parser.add_argument("--slot-ctx", type=int, default=2048, help="llama-server context per slot")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="lucedesk serve --set"
    )
    parser.add_argument("--build-only", action="store_true", help="find or build, print, exit")
    parser.add_argument("--write-docs", action="store_true", help="update --section")
    parser.add_argument(
        "--section", default=SECTION, help=f"the docs heading written (default '{SECTION}')"
    )
    return parser.parse_args(mine), passthrough


def main(argv: list[str]) -> None:
    args, passthrough = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    binary = find_llama_server(args.llama_server)
    llama_info = describe_llama_server(binary)
    say(f"llama-server: {binary} ({llama_info['version']})")
    if args.build_only:
        print(binary)
        return
    bench = bench_args(passthrough)
    model = resolve(args.model, say).path
    name = args.name or model.stem
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lucedesk-peer-")))
        log_dir = Path(tempfile.mkdtemp(prefix="lucedesk-peer-logs-"))
        ours_port, theirs_port = free_port(), free_port()
        llama_cmd = llama_server_cmd(binary, model, theirs_port, name, args)
        llama = start_server("llama.cpp", llama_cmd, theirs_port, log_dir)
        stack.callback(stop_server, llama)
        ours_cmd = lucedesk_cmd(model, ours_port, name, args.set)
        ours = start_server("lucedesk", ours_cmd, ours_port, log_dir)
        stack.callback(stop_server, ours)
        wait_healthy(llama)
        wait_healthy(ours)
        runs = abba(ours, llama, bench, tmp)
    say(f"server logs kept in {log_dir}")
    for note in disagreements(runs):
        say(f"warning: {note}; was the machine busy?")
    report = table(median_levels(runs["lucedesk"]), median_levels(runs["llama.cpp"]))
    print(report)
    if args.write_docs:
        command = shlex.join([".venv/bin/python", "bench/llama_cpp_peer.py", *argv])
        section = docs_section(report, command, llama_info, llama_cmd, args.section)
        DOCS.write_text(replace_section(DOCS.read_text(), section))
        say(f"wrote '{args.section}' in {DOCS}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        say("interrupted (the servers were stopped)")
        raise SystemExit(130) from None
