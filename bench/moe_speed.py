"""A mixture of experts against the dense model it matches in active parameters, on this
machine's engine (the cpu profile: bf16, C++ kernels, the files' own 4-bit blocks):

  dense  SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, 9/3 heads, 49,152 tokens)
  moe    the same with 8 experts of MLP 768 in every layer, 2 a token (qwen3moe): each token
         runs the dense model's MLP width, the file holds 4x its MLP weights

Both are random Q4_0 GGUF files this script writes (the default model's vocabulary, an 8-bit
embedding). Offline, closed loop, `ignore_eos`, prompt lookup off; C1 and C16 output tok/s
for each, and the bytes one decode step reads (the 4-bit weights' levels and scales, only
the experts the step's rows chose: counted during the run) against the bandwidth floor,
that many bytes at the rate this machine streams memory (measured in the same run).

    .venv/bin/python bench/moe_speed.py [--requests 16] [--output-len 128] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

DENSE = dict(layers=30, hidden=576, heads=9, kv_heads=3, ffn=1536, vocab=49152)
EXPERTS, PER_TOKEN, EXPERT_FFN = 8, 2, 768


def random_q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks (fp16 scale, 16 bytes of nibbles per 32 values). The scales are
    small beside the embeddings', so each token's hidden state stays its own through the
    layers and routers spread tokens over the experts as trained ones do (with larger
    weights every token's state converged and all picked the same two experts)."""
    blocks = rng.integers(0, 256, size=(rows * cols // 32, 18), dtype=np.uint8)
    scales = rng.uniform(0.0005, 0.002, blocks.shape[0]).astype(np.float16)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_model(path: Path, moe: bool, vocabulary_from: Path) -> Path:
    """A random GGUF of the dense or the MoE shape, Q4_0 matmuls, Q8_0 tied embedding."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from lucedesk.engine.models.gguf_file import GGUFFile

    if path.exists():
        return path
    d = DENSE
    rng = np.random.default_rng(0)
    source = GGUFFile(vocabulary_from)
    arch = "qwen3moe" if moe else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = d["hidden"] // d["heads"]
    w.add_block_count(d["layers"])
    w.add_context_length(8192)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["ffn"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    if moe:
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(PER_TOKEN)
        w.add_expert_feed_forward_length(EXPERT_FFN)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(source.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(source.require("tokenizer.ggml.tokens"))
    w.add_token_types(source.require("tokenizer.ggml.token_type"))
    w.add_token_merges(source.require("tokenizer.ggml.merges"))
    w.add_eos_token_id(int(source.require("tokenizer.ggml.eos_token_id")))
    embedding = rng.standard_normal((d["vocab"], d["hidden"])).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embedding, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(d["hidden"], np.float32))

    def q4(name: str, rows: int, cols: int, experts: int = 0) -> None:
        data = random_q4_0(rows * max(experts, 1), cols, rng)
        if experts:
            data = data.reshape(experts, rows, -1)
        w.add_tensor(name, data, raw_dtype=Q.Q4_0)

    for i in range(d["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d["hidden"], np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d["hidden"], np.float32))
        q4(p + "attn_q.weight", d["heads"] * head_dim, d["hidden"])
        q4(p + "attn_k.weight", d["kv_heads"] * head_dim, d["hidden"])
        q4(p + "attn_v.weight", d["kv_heads"] * head_dim, d["hidden"])
        q4(p + "attn_output.weight", d["hidden"], d["heads"] * head_dim)
        if moe:
            w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, np.float32))
            router = (rng.standard_normal((EXPERTS, d["hidden"])) * 0.5).astype(np.float32)
            w.add_tensor(p + "ffn_gate_inp.weight", router)
            q4(p + "ffn_gate_exps.weight", EXPERT_FFN, d["hidden"], EXPERTS)
            q4(p + "ffn_up_exps.weight", EXPERT_FFN, d["hidden"], EXPERTS)
            q4(p + "ffn_down_exps.weight", d["hidden"], EXPERT_FFN, EXPERTS)
        else:
            q4(p + "ffn_gate.weight", d["ffn"], d["hidden"])
            q4(p + "ffn_up.weight", d["ffn"], d["hidden"])
            q4(p + "ffn_down.weight", d["hidden"], d["ffn"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


STREAM = """
import time, torch
data = torch.ones(1 << 27, dtype=torch.float32)
times = []
for _ in range(7):
    start = time.perf_counter()
    data.sum()
    times.append(time.perf_counter() - start)
times.sort()
print(data.numel() * 4 / times[len(times) // 2])
"""


def stream_rate() -> float:
    """Bytes a second this machine reads from memory: the median of summing 512 MiB with
    torch's threads, in a process of its own (torch ops on this thread as well as on the
    engine's would run two OpenMP thread teams against each other for the cores)."""
    out = subprocess.run([sys.executable, "-c", STREAM], capture_output=True, text=True)
    return float(out.stdout.strip())


def step_bytes(model, experts_per_layer: float) -> int:
    """Weight bytes one decode step reads: every dense matmul and the LM head, and of each
    mixture `experts_per_layer` of its experts (the mean a step's rows chose)."""
    from lucedesk.kernels.quantized import GroupedLowBitWeight

    total = sum(p.nbytes for layer in model.layers for p in layer.quantized.values())
    total += model.lm_head_quantized.nbytes
    for _, moe in model.moe_blocks():
        for held in moe.experts.quantized.values():
            assert isinstance(held, GroupedLowBitWeight)
            total += int(held.nbytes * experts_per_layer / held.num_experts)
    return total


def run(path: Path, requests: int, output_len: int, log) -> dict:
    """Both concurrency levels on one engine, and how many experts its decode steps chose."""
    from lucedesk import profile
    from lucedesk.bench.offline import run_offline
    from lucedesk.engine import launch_engine
    from lucedesk.engine.models.moe import MoEBlock

    _, config, _ = profile.resolve("cpu", ["prompt_lookup=false", "max_slots=16"])
    built = launch_engine(path, config)
    engine = built.engine
    route = MoEBlock.route
    out: dict = {"weights": built.weights}
    for c in (1, 16):
        chosen: list[int] = []  # distinct experts of each layer of each decode-only step

        def counting(block, x, c=c, chosen=chosen):
            weights, ids = route(block, x)
            if x.shape[0] <= c:  # decode rows only (a prompt chunk is more rows)
                chosen.append(len(set(ids.flatten().tolist())))
            return weights, ids

        MoEBlock.route = counting
        try:
            ((_, summary),) = run_offline(engine, [c], requests, 256, output_len, log=log)
        finally:
            MoEBlock.route = route
        experts = float(np.mean(chosen)) if chosen else 0.0
        out[c] = dict(
            tok_s=summary.output_tok_s,
            tpot=summary.tpot_p50,
            bytes=step_bytes(built.loaded.model, experts),
            experts=experts,
        )
    engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    args = parser.parse_args()

    from platformdirs import user_cache_dir

    from lucedesk.catalog.resolve import resolve

    folder = Path(user_cache_dir("lucedesk")) / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    vocabulary = resolve(None, print).path
    paths = {
        "dense": write_model(folder / "dense-135m-q4_0.gguf", False, vocabulary),
        "moe": write_model(folder / "moe-8x-135m-active-q4_0.gguf", True, vocabulary),
    }
    rate = stream_rate()
    print(f"memory read rate: {rate / 1e9:.1f} GB/s")
    results = {
        name: run(path, args.requests, args.output_len, print) for name, path in paths.items()
    }
    lines = [
        f"Memory read rate (sum of 512 MiB, median of 7): {rate / 1e9:.1f} GB/s. "
        f"Offline, {args.requests} requests per level, 256-token prompts, "
        f"{args.output_len} output tokens, ignore_eos, prompt lookup off, q4 weights.",
        "",
        "| model | file | C1 tok/s | C1 TPOT p50 | C1 bytes/step | C1 floor | C16 tok/s "
        "| C16 experts/layer | C16 bytes/step | C16 floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        size = paths[name].stat().st_size / 1e6
        floor1 = r[1]["bytes"] / rate
        floor16 = r[16]["bytes"] / rate
        experts = f"{r[16]['experts']:.1f} of {EXPERTS}" if name == "moe" else "-"
        lines.append(
            f"| {name} | {size:.0f} MB | {r[1]['tok_s']:.1f} | {r[1]['tpot'] * 1e3:.1f} ms "
            f"| {r[1]['bytes'] / 1e6:.1f} MB "
            f"| {floor1 * 1e3:.2f} ms ({r[1]['tpot'] / floor1:.1f}x) "
            f"| {r[16]['tok_s']:.1f} | {experts} | {r[16]['bytes'] / 1e6:.1f} MB "
            f"| {floor16 * 1e3:.2f} ms |"
        )
    ratio1 = results["moe"][1]["tok_s"] / results["dense"][1]["tok_s"]
    ratio16 = results["moe"][16]["tok_s"] / results["dense"][16]["tok_s"]
    lines += ["", f"MoE / dense output tok/s: C1 {ratio1:.2f}x, C16 {ratio16:.2f}x."]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
