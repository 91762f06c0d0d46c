"""Writing small GGUF files for tests, with gguf's own writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from tests.conftest import CHATML, SPECIALS, write_tokenizer

# Block layouts of the K-quants: (bytes per 256 values, byte offsets of fp16 scale fields).
K_QUANT_F16_FIELDS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def random_k_quant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant blocks with random contents (gguf has no K-quant quantizer): random
    bytes, with each fp16 super-block scale set to a small finite value."""
    block_bytes, f16_offsets = K_QUANT_F16_FIELDS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for off in f16_offsets:
        scale = rng.uniform(0.00005, 0.0002, size=blocks.shape[0]).astype(np.float16)
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
) -> Path:
    """A random model; `types` maps a tensor role (token_embd, attn_q, ...) to its type."""
    rng = np.random.default_rng(seed)
    tok_dir = tokenizer_dir or path.parent / (path.stem + "-tok")
    tok_dir.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(tok_dir)
    tokens, token_types, merges = gguf_tokenizer_fields(tok_dir)
    head_dim = hidden // heads

    w = GGUFWriter(str(path), arch)
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
        if qtype in K_QUANT_F16_FIELDS:
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
    return path
