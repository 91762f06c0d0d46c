"""Reading llama.cpp GGUF files (one, or the parts of a split model): the header (metadata,
tensor table; catalog/gguf_header.py), the model config, and each tensor's bytes from a
memory map: dequantized weights under the shared names of
family.py, the 4-bit blocks of the dense projections, and each expert's slice of a mixture's
3-D expert tensors. The block formats themselves are decoded in gguf_blocks.py."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucedesk.catalog.gguf_header import read_header, split_parts
from lucedesk.engine.models.config import ModelConfig
from lucedesk.engine.models.families import BY_GGUF_ARCH
from lucedesk.engine.models.family import Family
from lucedesk.engine.models.gguf_blocks import (
    SUPPORTED_TYPES,
    BlockPart,
    FileBlocks,
    Levels,
    block_levels,
    dequantize_blocks,
)
from lucedesk.errors import ModelLoadError

# A mixture's experts: one 3-D tensor per projection, [experts, rows, cols] in PyTorch order
# (gate and up apart, or fused with the gate rows first).
EXPERT_PARTS = {
    "gate_up": (("ffn_gate_exps", "ffn_up_exps"), ("ffn_gate_up_exps",)),
    "down": (("ffn_down_exps",),),
}

# The GGUF tensors behind each fused projection (see llama.py), in their order there.
PROJECTION_PARTS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}

# GGUF layer tensor role -> shared name (family.py; "{i}" is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate",  # biases only: expert weights stay in the file
    "ffn_up_exps": "mlp.experts.up",
    "ffn_gate_up_exps": "mlp.experts.gate_up",
    "ffn_down_exps": "mlp.experts.down",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, family: Family | None = None) -> str | None:
    """The shared name of a GGUF tensor (None for tensors read elsewhere: rope_freqs, and
    expert weights, which stay in the file until a format is chosen)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    _, layer, role, kind = parts
    prefix = f"model.layers.{layer}."
    if role == "attn_sinks":
        return prefix + "self_attn.sinks"
    if role.endswith("_exps"):  # [E, rows] biases; the weights are an ExpertSource's
        return prefix + _LAYER_NAMES[role] + "_bias" if kind == "bias" else None
    names = {**_LAYER_NAMES, **(family.gguf_names if family else {})}
    return f"{prefix}{names[role]}.{kind}" if role in names else None


@dataclass(slots=True, frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order: [rows, cols]
    type_name: str
    type_id: int
    offset: int  # absolute offset of the data in its part's file
    nbytes: int
    part: int = 0  # which file of a split model holds it


class GGUFFile:
    """One model in GGUF: a file, or the parts of a split one (gguf_header.py), each mapped
    in place; metadata parsed at open, tensor data read from the maps on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        first = self._open(path)
        header = read_header(path)  # (the fit check read it already: not again)
        self._maps = [first]
        headers = [header]
        count = header.split_count
        if count > 1:
            if header.split_no != 0:
                raise ModelLoadError(
                    f"{path}: is part {header.split_no + 1} of {count} of a split model; "
                    "name its first part (-00001-of-...)"
                )
            for i, part in enumerate(split_parts(path, count)[1:], start=1):
                if not part.exists():
                    raise ModelLoadError(
                        f"{part}: part {i + 1} of {count} of {path.name} is missing"
                    )
                buf = self._open(part)
                more = read_header(part)
                if more.split_no != i or more.split_count != count:
                    raise ModelLoadError(
                        f"{part}: says it is part {more.split_no + 1} of {more.split_count}, "
                        f"not part {i + 1} of {count}"
                    )
                self._maps.append(buf)
                headers.append(more)
        self.metadata: dict[str, Any] = header.metadata
        self.tensors: dict[str, TensorInfo] = {}
        for part, h in enumerate(headers):
            for t in h.tensors:
                self.tensors[t.name] = TensorInfo(
                    t.name, t.shape, t.type_name, t.type_id, h.data_start + t.offset, t.nbytes, part
                )
        expected = self.metadata.get("split.tensors.count")
        if count > 1 and expected is not None and int(expected) != len(self.tensors):
            raise ModelLoadError(
                f"{path}: its {count} parts hold {len(self.tensors)} tensors, "
                f"the model has {expected}"
            )

    @staticmethod
    def _open(path: Path) -> mmap.mmap:
        try:
            with open(path, "rb") as f:
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot be read ({exc})") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelLoadError(f"{self.path}: missing metadata key {key!r}")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if arch not in BY_GGUF_ARCH:
            raise ModelLoadError(
                f"{self.path}: unsupported architecture {arch!r} "
                f"(supported: {', '.join(BY_GGUF_ARCH)})"
            )
        return arch

    @property
    def family(self) -> Family:
        return BY_GGUF_ARCH[self.architecture]

    def model_config(self) -> ModelConfig:
        arch = self.architecture
        family = self.family
        k = f"{arch}."
        hidden = int(self.require(k + "embedding_length"))
        heads = int(self.require(k + "attention.head_count"))
        kv_heads = int(self.get(k + "attention.head_count_kv", heads))
        head_dim = int(self.get(k + "attention.key_length", hidden // heads))
        names = set(self.tensors)
        vocab = self.get(k + "vocab_size") or len(self.get("tokenizer.ggml.tokens", []))
        rope_scaling = None
        if "rope_freqs.weight" in names:
            factors = self.tensor("rope_freqs.weight").tolist()
            rope_scaling = {"rope_type": "freq_factors", "factors": factors}
        elif self.get(k + "rope.scaling.type") == "linear":
            rope_scaling = {
                "rope_type": "linear",
                "factor": float(self.get(k + "rope.scaling.factor")),
            }
        try:
            config = family.from_gguf(
                self,
                ModelConfig(
                    architecture=family.name,
                    vocab_size=int(vocab),
                    hidden_size=hidden,
                    intermediate_size=int(self.get(k + "feed_forward_length") or 0),
                    num_layers=int(self.require(k + "block_count")),
                    num_heads=heads,
                    num_kv_heads=kv_heads,
                    head_dim=head_dim,
                    rms_norm_eps=float(self.get(k + "attention.layer_norm_rms_epsilon", 1e-5)),
                    rope_theta=float(self.get(k + "rope.freq_base", 10000.0)),
                    rope_scaling=rope_scaling,
                    max_position_embeddings=int(self.get(k + "context_length", 4096)),
                    tie_word_embeddings="output.weight" not in names,
                    name=str(self.get("general.name", self.path.stem)),
                ),
            )
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{self.path}: invalid metadata ({exc})") from None
        if config.is_moe:  # a layer without a router has a dense MLP
            dense = (
                i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names
            )
            config.dense_layers = tuple(dense)
        config.check(str(self.path))
        return config

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor dequantized to float32, in PyTorch's [rows, cols] order."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        return self._dequantize(info)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """A tensor's bytes (its blocks), read from the memory map without a copy."""
        return np.frombuffer(self._maps[t.part], np.uint8, t.nbytes, t.offset)

    def _dequantize(self, t: TensorInfo) -> torch.Tensor:
        if t.type_name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor {t.name!r} has type {t.type_name}, which lucedesk does not "
                f"load (supported: {', '.join(SUPPORTED_TYPES)})"
            )
        return dequantize_blocks(self.raw(t), t.type_name, t.shape)

    def projection_tensors(self, layer: int | None, proj: str) -> list[TensorInfo]:
        """The tensors behind one fused projection (`layer` None: the LM head, which is
        the embedding table when the file has no output tensor; or with `proj`
        "embed_tokens", the embedding table)."""
        if layer is None:
            head = "output.weight" in self.tensors and proj != "embed_tokens"
            names = ["output.weight" if head else "token_embd.weight"]
        else:
            names = [f"blk.{layer}.{part}.weight" for part in PROJECTION_PARTS[proj]]
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise ModelLoadError(f"{self.path}: missing tensor {missing[0]!r}")
        return [self.tensors[n] for n in names]

    def expert_tensors(self, layer: int, proj: str) -> list[TensorInfo]:
        """The 3-D tensors of one layer's experts for "gate_up" (gate then up) or "down"."""
        for parts in EXPERT_PARTS[proj]:
            names = [f"blk.{layer}.{part}.weight" for part in parts]
            if all(n in self.tensors for n in names):
                return [self.tensors[n] for n in names]
        raise ModelLoadError(
            f"{self.path}: missing tensor 'blk.{layer}.{EXPERT_PARTS[proj][0][0]}.weight'"
        )

    def expert_slice(self, t: TensorInfo, expert: int) -> TensorInfo:
        """One expert's [rows, cols] part of a 3-D expert tensor."""
        per_expert = t.nbytes // t.shape[0]
        offset = t.offset + expert * per_expert
        return TensorInfo(t.name, t.shape[1:], t.type_name, t.type_id, offset, per_expert, t.part)

    def expert_levels(self, t: TensorInfo, expert: int) -> Levels:
        return block_levels(self.raw(self.expert_slice(t, expert)), t.type_name)

    def dequantize_expert(self, t: TensorInfo, expert: int) -> torch.Tensor:
        """One expert's [rows, cols] weight in float32."""
        return self._dequantize(self.expert_slice(t, expert))

    def blocks(self, config: ModelConfig, layer: int | None, proj: str) -> FileBlocks:
        """One fused projection's blocks: its parts' types, and (`FileBlocks.levels`) where
        they are grids, levels uint8 [N, K] with d and m float32 [N, K / 32] and
        weight = d * level + m, exactly as the file holds it, then where every part is a
        K-quant the factors of d and m (gguf_blocks.Levels)."""
        infos = self.projection_tensors(layer, proj)
        types = tuple(t.type_name for t in infos)
        return FileBlocks(
            types,
            lambda: self._levels(config, infos),
            lambda: [self._part(config, t) for t in infos],
            lambda: torch.cat([self._values(config, t) for t in infos]),
        )

    def _heads(self, config: ModelConfig, t: TensorInfo) -> int:
        """The heads whose rotary rows llama.cpp's converter interleaved in `t` (0: none)."""
        if not self.family.permuted_qk:
            return 0
        if t.name.endswith("attn_q.weight"):
            return config.num_heads
        return config.num_kv_heads if t.name.endswith("attn_k.weight") else 0

    def _part(self, config: ModelConfig, t: TensorInfo) -> BlockPart:
        return BlockPart(self.raw(t), t.type_name, t.shape, self._heads(config, t))

    def _values(self, config: ModelConfig, t: TensorInfo) -> torch.Tensor:
        """One tensor's values (float32), its rotary rows in the Hugging Face order."""
        heads = self._heads(config, t)
        w = self._dequantize(t)
        return unpermute(w, heads) if heads else w

    def expert_parts(self, layer: int, proj: str, expert: int) -> list[BlockPart]:
        """One expert's slices of the expert tensors behind `proj`, as the file holds them."""
        parts = []
        for t in self.expert_tensors(layer, proj):
            one = self.expert_slice(t, expert)
            parts.append(BlockPart(self.raw(one), t.type_name, one.shape))
        return parts

    def _levels(self, config: ModelConfig, infos: list[TensorInfo]) -> tuple[torch.Tensor, ...]:
        parts = []
        for t in infos:
            rows, cols = t.shape
            held = block_levels(self.raw(t), t.type_name)
            part = [torch.from_numpy(held.levels).view(rows, cols)]
            part += [torch.from_numpy(a).view(rows, -1) for a in (held.d, held.m)]
            if held.factors is not None:
                part += [torch.from_numpy(a).view(rows, -1) for a in held.factors]
            heads = self._heads(config, t)
            if heads:
                part = [unpermute(x, heads) for x in part]
            parts.append(part)
        if len(parts) == 1:  # an unfused weight (the LM head) without another copy
            return tuple(parts[0])
        whole = min(len(p) for p in parts)  # factors only where every part has them
        return tuple(torch.cat([p[i] for p in parts]) for i in range(whole))

    def weights(
        self, config: ModelConfig, matmuls: bool = True, embedding: bool = True
    ) -> dict[str, torch.Tensor]:
        """Every model tensor but the experts' weights, dequantized, under its shared name,
        with llama.cpp's rotary row permutation of q/k undone (only the llama architecture
        is permuted by its converter); without `matmuls` (`embedding`) the projections and
        the LM head (the embedding table) are left in the file (`blocks` reads them)."""
        family = self.family
        out: dict[str, torch.Tensor] = {}
        left = set()
        if not matmuls:
            parts = [p for ps in PROJECTION_PARTS.values() for p in ps]
            left = {f"blk.{i}.{p}.weight" for i in range(config.num_layers) for p in parts}
            left.add("output.weight")
        if not embedding:
            left.add("token_embd.weight")
        for t in self.tensors.values():
            name = hf_name(t.name, family)
            if name is None or t.name in left:
                continue
            w = self._dequantize(t)
            if family.permuted_qk:
                if name.endswith("q_proj.weight"):
                    w = unpermute(w, config.num_heads)
                elif name.endswith("k_proj.weight"):
                    w = unpermute(w, config.num_kv_heads)
            out[name] = w
        for i in range(config.num_layers):  # gate and up expert biases, fused as the weights
            p = f"model.layers.{i}.mlp.experts."
            if p + "gate_bias" in out and p + "up_bias" in out:
                out[p + "gate_up_bias"] = torch.cat(
                    [out.pop(p + "gate_bias"), out.pop(p + "up_bias")], -1
                )
        return out


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves each head's rotary halves:

    HF rows of one head:  [x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)]
    GGUF rows:            [x0 y0 x1 y1 .. ]
    """
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
