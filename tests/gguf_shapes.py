"""GGUF files of a real model's shape without its weights: the header a file of that model
and quant carries (every tensor's name, shape and type), the data section left as a hole
in a sparse file. What reads headers alone (the fit, `lucedesk models`) sees the file as it
is; nothing loads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from lucedesk.catalog.held_formats import file_bytes


def write_header_only(
    path: Path, arch: str, metadata: dict, tensors: list[tuple[str, tuple[int, ...], str]]
) -> Path:
    """`tensors`: (name, PyTorch-order shape, GGUF type); `metadata` under `arch.`."""
    w = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        w.add_key_value(f"{arch}.{key}", value, _value_type(value))
    w.add_file_type(15)  # MOSTLY_Q4_K_M
    w.add_token_list([f"t{i}" for i in range(metadata.get("vocab_size", 1))])
    total = 0
    for name, shape, kind in tensors:
        numel = int(np.prod(shape))
        nbytes = file_bytes(kind, numel)
        total += -(-nbytes // 32) * 32  # each tensor aligned to 32 bytes
        if kind == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:  # a quantized tensor's shape in bytes, as gguf's writer takes it
            row = file_bytes(kind, shape[-1])
            w.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8), nbytes, Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:  # the data: a hole, as long as the tensors
        f.seek(0, 2)
        start = -(-f.tell() // 32) * 32
        f.truncate(start + total)
    return path


def _value_type(value):
    from gguf import GGUFValueType

    return GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32


def qwen3_30b_a3b_q4_k_m(path: Path) -> Path:
    """Qwen3-30B-A3B's shape in llama.cpp's Q4_K_M mix: 48 layers, 128 experts of 768,
    hidden 2048, 32 query and 4 KV heads of 128; attention and experts in Q4_K, attn_v and
    ffn_down_exps in Q6_K where llama.cpp's Q4_K_M gives more bits (the first and last
    eighth of the layers and every third between), the LM head in Q6_K."""
    layers, experts, hidden, inter, vocab = 48, 128, 2048, 768, 151936
    meta = dict(
        block_count=layers, context_length=40960, embedding_length=hidden,
        feed_forward_length=6144, expert_feed_forward_length=inter, expert_count=experts,
        expert_used_count=8, vocab_size=vocab, rope_freq_base=1e6,
        **{"attention.head_count": 32, "attention.head_count_kv": 4,
           "attention.key_length": 128, "attention.value_length": 128,
           "attention.layer_norm_rms_epsilon": 1e-6},
    )  # fmt: skip
    tensors = [("token_embd.weight", (vocab, hidden), "Q4_K")]
    tensors += [
        ("output_norm.weight", (hidden,), "F32"),
        ("output.weight", (vocab, hidden), "Q6_K"),
    ]
    for i in range(layers):
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (hidden,), "F32"),
            (p + "ffn_norm.weight", (hidden,), "F32"),
            (p + "attn_q_norm.weight", (128,), "F32"),
            (p + "attn_k_norm.weight", (128,), "F32"),
            (p + "attn_q.weight", (4096, hidden), "Q4_K"),
            (p + "attn_k.weight", (512, hidden), "Q4_K"),
            (p + "attn_v.weight", (512, hidden), "Q6_K" if more else "Q4_K"),
            (p + "attn_output.weight", (hidden, 4096), "Q4_K"),
            (p + "ffn_gate_inp.weight", (experts, hidden), "F32"),
            (p + "ffn_gate_exps.weight", (experts, inter, hidden), "Q4_K"),
            (p + "ffn_up_exps.weight", (experts, inter, hidden), "Q4_K"),
            (p + "ffn_down_exps.weight", (experts, hidden, inter), "Q6_K" if more else "Q4_K"),
        ]
    return write_header_only(path, "qwen3moe", meta, tensors)
