"""Writing small GGUF files for tests, with gguf's own writer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from tests.conftest import CHATML, SPECIALS, write_tokenizer

# Block layouts gguf has no quantizer for: (values, bytes a block, byte offsets of its fp16
# scale fields, the range those scales are drawn from).
RANDOM_BLOCKS = {
    Q.Q4_K: (256, 144, (0, 2), (0.00005, 0.0002)),
    Q.Q5_K: (256, 176, (0, 2), (0.00005, 0.0002)),
    Q.Q6_K: (256, 210, (208,), (0.00005, 0.0002)),
    Q.IQ4_NL: (32, 18, (0,), (0.0002, 0.0008)),
    Q.IQ4_XS: (256, 136, (0,), (0.00001, 0.00003)),
}


def random_k_quant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks with random contents of a type gguf has no quantizer for (the
    K-quants, IQ4_NL, IQ4_XS): random bytes, with each fp16 scale set to a small finite
    value."""
    values, block_bytes, f16_offsets, (low, high) = RANDOM_BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // values, block_bytes), dtype=np.uint8)
    for off in f16_offsets:
        scale = rng.uniform(low, high, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def gguf_tokenizer_fields(folder: Path) -> tuple[list[str], list[int], list[str]]:
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def write_gguf(
    path: Path,
    types: dict[str, Q],
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    arch: str = "llama",
    seed: int = 0,
    tokenizer_dir: Path | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """A random model; `types` maps a tensor role (token_embd, attn_q, ...) to its type;
    `split_max_tensors`: split into parts of that many tensors, as llama.cpp's gguf-split
    does (`path`'s stem + -00001-of-0000N.gguf; returns the first part's path)."""
    rng = np.random.default_rng(seed)
    tok_dir = tokenizer_dir or path.parent / (path.stem + "-tok")
    tok_dir.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(tok_dir)
    tokens, token_types, merges = gguf_tokenizer_fields(tok_dir)
    head_dim = hidden // heads

    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def add(name: str, role: str, rows: int, cols: int) -> None:
        qtype = types.get(role, Q.F32)
        if qtype in RANDOM_BLOCKS:
            w.add_tensor(name, random_k_quant(rows, cols, qtype, rng), raw_dtype=qtype)
            return
        data = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, data)
        elif qtype == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)

    def add_norm(name: str, size: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    add("token_embd.weight", "token_embd", vocab, hidden)
    add_norm("output_norm.weight", hidden)
    add("output.weight", "output", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        add_norm(p + "attn_norm.weight", hidden)
        add_norm(p + "ffn_norm.weight", hidden)
        add(p + "attn_q.weight", "attn_q", heads * head_dim, hidden)
        add(p + "attn_k.weight", "attn_k", kv_heads * head_dim, hidden)
        add(p + "attn_v.weight", "attn_v", kv_heads * head_dim, hidden)
        add(p + "attn_output.weight", "attn_output", hidden, heads * head_dim)
        add(p + "ffn_gate.weight", "ffn_gate", intermediate, hidden)
        add(p + "ffn_up.weight", "ffn_up", intermediate, hidden)
        add(p + "ffn_down.weight", "ffn_down", hidden, intermediate)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = w.format_shard_names(path)
    return parts[0]


# -- the new families, written from a tiny Hugging Face checkpoint as llama.cpp's converter
# writes them: its tensor names, gate|up experts split into two 3-D tensors ([E, rows,
# cols] in PyTorch order), gpt-oss's interleaved gate/up rows taken apart and its x @ W
# experts transposed, Gemma's norms stored as 1 + w.

GGUF_ARCH = {"qwen3moe": "qwen3moe", "gpt-oss": "gpt-oss", "gemma3": "gemma3"}
LAYER_ROLES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
POST_ATTENTION = {"gemma3": "post_attention_norm", "gpt-oss": "post_attention_norm"}


def hf_to_gguf_tensors(folder: Path, arch: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, float32 (experts 3-D)."""
    from safetensors.numpy import load_file

    hf = {k: v.astype(np.float32) for k, v in load_file(str(folder / "model.safetensors")).items()}
    config = json.loads((folder / "config.json").read_text())
    out = {"token_embd.weight": hf.pop("model.embed_tokens.weight")}
    out["output_norm.weight"] = hf.pop("model.norm.weight")
    if "lm_head.weight" in hf:
        out["output.weight"] = hf.pop("lm_head.weight")
    roles = dict(LAYER_ROLES)
    roles["post_attention_layernorm"] = POST_ATTENTION.get(arch, "ffn_norm")
    roles |= {
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    for i in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        experts = p + "mlp.experts."
        if experts + "0.gate_proj.weight" in hf:  # qwen3moe: one tensor per expert
            num = config["num_local_experts"]
            for hf_part, part in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                stacked = [hf.pop(f"{experts}{e}.{hf_part}.weight") for e in range(num)]
                out[f"{b}ffn_{part}_exps.weight"] = np.stack(stacked)
            out[b + "ffn_gate_inp.weight"] = hf.pop(p + "mlp.gate.weight")
        if experts + "gate_up_proj" in hf:  # gpt-oss: x @ W, gate and up interleaved
            w = hf.pop(experts + "gate_up_proj").transpose(0, 2, 1)  # [E, 2I, H]
            out[b + "ffn_gate_exps.weight"] = np.ascontiguousarray(w[:, 0::2])
            out[b + "ffn_up_exps.weight"] = np.ascontiguousarray(w[:, 1::2])
            bias = hf.pop(experts + "gate_up_proj_bias")
            out[b + "ffn_gate_exps.bias"] = np.ascontiguousarray(bias[:, 0::2])
            out[b + "ffn_up_exps.bias"] = np.ascontiguousarray(bias[:, 1::2])
            down = hf.pop(experts + "down_proj").transpose(0, 2, 1)
            out[b + "ffn_down_exps.weight"] = np.ascontiguousarray(down)
            out[b + "ffn_down_exps.bias"] = hf.pop(experts + "down_proj_bias")
            out[b + "ffn_gate_inp.weight"] = hf.pop(p + "mlp.router.weight")
            out[b + "ffn_gate_inp.bias"] = hf.pop(p + "mlp.router.bias")
        if p + "self_attn.sinks" in hf:
            out[b + "attn_sinks.weight"] = hf.pop(p + "self_attn.sinks")
        for name in [n for n in hf if n.startswith(p)]:
            role, kind = name[len(p) :].rsplit(".", 1)
            out[f"{b}{roles[role]}.{kind}"] = hf.pop(name)
    assert not hf, f"tensors left: {sorted(hf)}"
    if arch == "gemma3":
        for name in [n for n in out if n.endswith("norm.weight")]:
            out[name] = out[name] + 1.0
    return out


def write_family_gguf(folder: Path, path: Path, arch: str, experts: Q = Q.F32) -> Path:
    """The tiny checkpoint in `folder` as a GGUF file, its expert weights in `experts`
    (Q8_0 and MXFP4 quantized from the checkpoint's values; Q4_K random blocks, which gguf
    has no quantizer for), every other tensor in F32."""
    rng = np.random.default_rng(0)
    config = json.loads((folder / "config.json").read_text())
    gguf_arch = GGUF_ARCH[arch]
    tokens, token_types, merges = gguf_tokenizer_fields(folder)
    w = GGUFWriter(str(path), gguf_arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base((rope.get("full_attention") or rope).get("rope_theta", 10000.0))
    w.add_vocab_size(config["vocab_size"])
    if arch == "qwen3moe":
        w.add_expert_count(config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "gpt-oss":
        w.add_expert_count(config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
        w.add_sliding_window(config["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, data in hf_to_gguf_tensors(folder, arch).items():
        if "_exps.weight" in name and experts != Q.F32:
            rows = data.reshape(-1, data.shape[-1])
            if experts in RANDOM_BLOCKS:
                blocks = random_k_quant(*rows.shape, experts, rng)
            else:
                blocks = quants.quantize(rows, experts)
            w.add_tensor(name, blocks.reshape(*data.shape[:-1], -1), raw_dtype=experts)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_expert_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every 3-D expert tensor of a GGUF file, dequantized by gguf's own code (float32)."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        if "_exps.weight" in t.name:
            shape = [int(d) for d in reversed(t.shape)]
            values = quants.dequantize(np.asarray(t.data), t.tensor_type)
            out[t.name] = values.reshape(shape).astype(np.float32)
    return out
