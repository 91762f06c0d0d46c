"""Reading llama.cpp GGUF files: model config, dequantized weights (HF names), tokenizer spec."""

from __future__ import annotations

import functools
import logging
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucedesk.engine.models.llama import ModelConfig
from lucedesk.errors import ModelLoadError

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # kept as 4-bit levels by `weights = "q4"`

# The GGUF tensors behind each fused projection (see llama.py), in their order there.
PROJECTION_PARTS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}

# GGUF tensor name -> Hugging Face name ("{i}" is the layer index).
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
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True, frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order: [rows, cols]
    type_name: str
    type_id: int
    offset: int  # absolute offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class FourBitBlocks:
    """One fused projection's blocks; read and decoded only when `groups` is asked for, so
    checking a file's types costs nothing."""

    type_name: str  # the first part not in a 4-bit type, else the first part's
    decode: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None

    @property
    def four_bit(self) -> bool:
        return self.decode is not None

    @functools.cached_property
    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(levels, d, m), or None when a part is not in a 4-bit type."""
        return None if self.decode is None else self.decode()


class _Cursor:
    """Sequential little-endian reads over the file's bytes."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF header")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.take("<I"), self.take("<Q")
            if elem in _SCALARS:  # read numeric arrays in one go
                dtype = np.dtype(_SCALARS[elem])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ModelLoadError(f"{self.path}: truncated GGUF header")
                arr = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos = end
                return arr.tolist()
            return [self.value(elem) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF value type {kind}")


class GGUFFile:
    """One GGUF file: metadata parsed at open, tensor data read from a memory map on demand."""

    def __init__(self, path: Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot be read ({exc})") from None
        cur = _Cursor(self._map, path)
        if len(self._map) < 24 or self._map[:4] != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            type_id, offset = cur.take("<I"), cur.take("<Q")
            infos.append((name, dims, type_id, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has unknown type id {type_id}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = math.prod(dims)
            nbytes = count // block * type_size
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise ModelLoadError(
                    f"{path}: truncated: tensor {name!r} needs bytes up to {start + nbytes}, "
                    f"the file has {len(self._map)}"
                )
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors[name] = TensorInfo(name, shape, qtype.name, type_id, start, nbytes)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelLoadError(f"{self.path}: missing metadata key {key!r}")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: unsupported architecture {arch!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return arch

    def model_config(self) -> ModelConfig:
        arch = self.architecture
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
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.require(k + "feed_forward_length")),
            num_layers=int(self.require(k + "block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(self.get(k + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.get(k + "rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(self.get(k + "context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            name=str(self.get("general.name", self.path.stem)),
        )

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor dequantized to float32, in PyTorch's [rows, cols] order."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        return self._dequantize(info)

    def _dequantize(self, t: TensorInfo) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        if t.type_name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor {t.name!r} has type {t.type_name}, which lucedesk does not "
                f"load (supported: {', '.join(SUPPORTED_TYPES)})"
            )
        raw = np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)
        rows = math.prod(t.shape[:-1]) if len(t.shape) > 1 else 1
        qtype = GGMLQuantizationType(t.type_id)
        if t.type_name == "F32":
            array = raw.view(np.float32).reshape(t.shape).copy()
        elif t.type_name == "F16":
            array = raw.view(np.float16).reshape(t.shape).astype(np.float32)
        else:
            array = quants.dequantize(raw.reshape(rows, -1), qtype)
            array = np.ascontiguousarray(array, dtype=np.float32).reshape(t.shape)
        return torch.from_numpy(array)

    def projection_tensors(self, layer: int | None, proj: str) -> list[TensorInfo]:
        """The tensors behind one fused projection (`layer` None: the LM head, which is
        the embedding table when the file has no output tensor)."""
        if layer is None:
            names = ["output.weight" if "output.weight" in self.tensors else "token_embd.weight"]
        else:
            names = [f"blk.{layer}.{part}.weight" for part in PROJECTION_PARTS[proj]]
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise ModelLoadError(f"{self.path}: missing tensor {missing[0]!r}")
        return [self.tensors[n] for n in names]

    def four_bit(self, config: ModelConfig, layer: int | None, proj: str) -> FourBitBlocks:
        """One fused projection as 4-bit levels with an affine scale per group of 32
        inputs: (levels uint8 [N, K] in 0..15, d and m float32 [N, K / 32]) with
        weight = d * level + m, exactly as the file's blocks hold it; no groups when a
        part is in another type (named)."""
        infos = self.projection_tensors(layer, proj)
        other = [t.type_name for t in infos if t.type_name not in FOUR_BIT_TYPES]
        if other:
            return FourBitBlocks(other[0], None)
        return FourBitBlocks(infos[0].type_name, lambda: self._four_bit_groups(config, infos))

    def _four_bit_groups(
        self, config: ModelConfig, infos: list[TensorInfo]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parts = []
        for t in infos:
            raw = np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)
            levels, d, m = (torch.from_numpy(a) for a in four_bit_groups(raw, t.type_name))
            rows, cols = t.shape
            levels, d, m = levels.view(rows, cols), d.view(rows, -1), m.view(rows, -1)
            if config.architecture == "llama" and t.name.endswith(
                ("attn_q.weight", "attn_k.weight")
            ):
                heads = config.num_heads if "attn_q" in t.name else config.num_kv_heads
                levels, d, m = (unpermute(x, heads) for x in (levels, d, m))
            parts.append((levels, d, m))
        levels, d, m = (torch.cat(x).contiguous() for x in zip(*parts))
        return levels, d, m

    def weights(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        """Every model tensor, dequantized, under its HF name, with llama.cpp's rotary row
        permutation of q/k undone (only the llama architecture is permuted by its converter)."""
        out: dict[str, torch.Tensor] = {}
        for t in self.tensors.values():
            name = hf_name(t.name)
            if name is None:
                continue  # rope_freqs and other tensors read elsewhere
            w = self._dequantize(t)
            if config.architecture == "llama":
                if name.endswith("q_proj.weight"):
                    w = unpermute(w, config.num_heads)
                elif name.endswith("k_proj.weight"):
                    w = unpermute(w, config.num_kv_heads)
            out[name] = w
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


def four_bit_groups(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of a 4-bit type -> (levels uint8 [values], d, m float32 [values / 32]) with
    value = d * level + m, level in 0..15, in the tensor's value order.

    Q4_0 (18 bytes / 32): fp16 d, 16 bytes of nibbles; value = d * (level - 8).
    Q4_1 (20 bytes / 32): fp16 d and m; value = d * level + m.
    Q4_K (144 bytes / 256): fp16 d and dmin, 12 bytes of 6-bit scales and mins for eight
    groups of 32, 128 bytes of nibbles; value = d * scale * level - dmin * min.
    In Q4_0 and Q4_1 a block's byte j holds value j (low nibble) and j + 16 (high); in
    Q4_K each 32 bytes hold two groups, the low nibbles the first."""
    if type_name in ("Q4_0", "Q4_1"):
        blocks = raw.reshape(-1, 18 if type_name == "Q4_0" else 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        if type_name == "Q4_0":
            m, qs = -8 * d, blocks[:, 2:]
        else:
            m, qs = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0], blocks[:, 4:]
        levels = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        return levels.reshape(-1), d, m
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        scales, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        levels = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [blocks, 4, 2, 32]
        group_d = d * scales.astype(np.float32)
        group_m = -(dmin * mins.astype(np.float32))
        return levels.reshape(-1), group_d.reshape(-1), group_m.reshape(-1)
    raise ValueError(f"{type_name} is not a 4-bit type ({', '.join(FOUR_BIT_TYPES)})")
