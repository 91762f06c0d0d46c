"""What a model file says of itself without loading it: its architecture, parameters, quant,
size, context and the shape its KV cache takes. Read from a GGUF header or from a Hugging
Face folder's config.json and safetensors headers; the engine sizes memory from it."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lucedesk.catalog.gguf_header import Header, read_header, split_parts
from lucedesk.catalog.held_formats import BLOCK_TYPES, file_bytes
from lucedesk.catalog.quants import label_type
from lucedesk.errors import ModelLoadError

# The first layer's gate weights, dense or a mixture's (gate|up fused, or the gate alone):
# the type the held-format rule goes by (the loader reads the same, held_weights.mlp_type).
FIRST_MLP = ("blk.0.ffn_gate.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_up_exps.weight")


@dataclass(slots=True)
class ModelSummary:
    architecture: str  # GGUF architecture or config.json model_type: llama, qwen3moe...
    params: int  # every weight, embedding included
    quant: str  # Q4_K_M, MXFP4, bfloat16...
    size_bytes: int  # on disk, every part
    context: int  # the model's own context length, in tokens
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int
    tied_embeddings: bool  # the LM head is the embedding table
    # The GGUF type of its first layer's MLP weights (its experts' in a mixture), what the
    # held-format rule goes by (catalog/held_formats.py); "" for a Hugging Face folder.
    mlp_type: str = ""
    # Its matmul weights (the LM head among them, the embedding table not) by GGUF type:
    # how many values of each; empty where no tensor table was read (see `matmuls`).
    matmul_numel: dict[str, int] = field(default_factory=dict)
    embedding_type: str = ""  # the embedding table's GGUF type
    tensor_types: tuple[str, ...] = ()  # GGML's names of the types its tensors are in
    name: str = ""  # what the file calls the model (general.name), if anything
    chat_template: bool = True  # the file carries one

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def matmuls(self) -> dict[str, int]:
        """The matmul weights' values by GGUF type: the tensor table's count, else (a quant
        known by its label and size alone, a Hugging Face folder: type "") every parameter
        but the embedding's in the type the label names, as many as the file's bytes would
        hold in that type (a Q4_K_M's Q6_K parts count as more Q4_K weights)."""
        if self.matmul_numel:
            return dict(self.matmul_numel)
        kind = label_type(self.quant) or self.mlp_type
        count = max(self.params - self.embedding_params, 0)
        if kind in BLOCK_TYPES and self.params:
            ratio = self.size_bytes / file_bytes(kind, 256 * self.params) * 256
            count = int(count * max(ratio, 1.0))
        return {kind: count}

    def embedding(self) -> tuple[str, int]:
        """The embedding table's GGUF type ("" where unknown) and values."""
        return self.embedding_type or label_type(self.quant), self.embedding_params

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelSummary:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def file_type_name(value: object) -> str:
    """general.file_type as llama.cpp names it: Q4_K_M, MXFP4_MOE, BF16..."""
    import gguf

    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return ""


def summarize_gguf(
    header: Header, size_bytes: int, source: str, others: tuple[Header, ...] = ()
) -> ModelSummary:
    """A model's summary from its GGUF header, a split model's first part's with the other
    parts' (`others`; without them, what the first part does not hold is estimated from
    `size_bytes`, the size of all parts)."""
    meta = header.metadata
    tensors = [t for h in (header, *others) for t in h.tensors]
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{source}: missing metadata key 'general.architecture'")

    def num(key: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # a value per layer: the largest sizes the cache
            value = max(value) if value else default
        if value is None:
            raise ModelLoadError(f"{source}: missing metadata key '{arch}.{key}'")
        return int(value)

    hidden, heads = num("embedding_length"), num("attention.head_count")
    names = {t.name for t in tensors}
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    # The weights a held format holds: every 2-D (or an expert's 3-D) tensor but the
    # embedding table and the routers (float32 in the model).
    matmuls = [
        t
        for t in tensors
        if len(t.shape) >= 2
        and t.name.endswith(".weight")  # (gpt-oss's experts' biases are 2-D)
        and t.name != "token_embd.weight"
        and "ffn_gate_inp" not in t.name
    ]
    matmul_numel: dict[str, int] = {}
    for t in matmuls:
        matmul_numel[t.type_name] = matmul_numel.get(t.type_name, 0) + t.numel
    embedding = next((t for t in tensors if t.name == "token_embd.weight"), None)
    first_mlp = next((t for t in tensors if t.name in FIRST_MLP), None)
    declared = int(meta.get("split.tensors.count", len(tensors)))
    params = sum(t.numel for t in tensors)
    if declared > len(tensors):  # a split model's first part alone: scale by its bytes
        share = size_bytes / (sum(t.nbytes for t in tensors) or 1)
        params = int(params * share)
        matmul_numel = {k: int(v * share) for k, v in matmul_numel.items()}
    return ModelSummary(
        architecture=arch,
        params=params,
        quant=file_type_name(meta.get("general.file_type")) or _dominant_type(matmuls),
        size_bytes=size_bytes,
        context=num("context_length", 4096),
        num_layers=num("block_count"),
        num_kv_heads=num("attention.head_count_kv", heads),
        head_dim=num("attention.key_length", hidden // heads),
        vocab_size=int(vocab),
        hidden_size=hidden,
        tied_embeddings="output.weight" not in names,
        mlp_type=first_mlp.type_name if first_mlp is not None else "",
        matmul_numel=matmul_numel,
        embedding_type=embedding.type_name if embedding is not None else "",
        tensor_types=tuple(sorted({t.type_name for t in tensors})),
        name=str(meta.get("general.name") or ""),
        chat_template=bool(meta.get("tokenizer.chat_template")),
    )


def _dominant_type(tensors: list) -> str:
    """The type holding most of the bytes, for a file that names no file type."""
    held: dict[str, int] = {}
    for t in tensors:
        held[t.type_name] = held.get(t.type_name, 0) + t.nbytes
    return max(held, key=held.__getitem__) if held else ""


def summarize_path(path: Path) -> ModelSummary:
    """A `.gguf` file (a split one's first part) or a Hugging Face folder."""
    if path.is_dir():
        return summarize_folder(path)
    header = read_header(path)
    if header.split_count <= 1:
        return summarize_gguf(header, path.stat().st_size, str(path))
    parts = split_parts(path, header.split_count)
    missing = next((p for p in parts if not p.exists()), None)
    if missing is not None:
        raise ModelLoadError(f"{missing}: a part of {path.name} is missing")
    others = tuple(read_header(p) for p in parts[1:])
    return summarize_gguf(header, sum(p.stat().st_size for p in parts), str(path), others)


def _safetensors_params(path: Path) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 << 20:
            raise ModelLoadError(f"{path}: not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def summarize_folder(folder: Path) -> ModelSummary:
    """A Hugging Face folder: config.json (its text_config where it has one) and the
    safetensors files' headers."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc})") from None
    text = raw.get("text_config") or raw
    files = sorted(folder.glob("*.safetensors"))
    try:
        params = sum(_safetensors_params(f) for f in files)
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        summary = ModelSummary(
            architecture=str(text.get("model_type") or raw.get("model_type") or ""),
            params=params,
            quant=str(raw.get("torch_dtype") or text.get("torch_dtype") or raw.get("dtype") or ""),
            size_bytes=sum(f.stat().st_size for f in files),
            context=int(text.get("max_position_embeddings") or 4096),
            num_layers=int(text["num_hidden_layers"]),
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            tied_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings"))),
            name=folder.name,
            chat_template=_folder_has_template(folder),
        )
    except (KeyError, TypeError, ValueError, OSError, struct.error) as exc:
        raise ModelLoadError(f"{folder}: cannot be summarized ({exc})") from None
    if "quantization_config" in raw or "quantization" in raw:
        summary.quant = (
            "quantized ("
            + str(
                (raw.get("quantization_config") or raw.get("quantization") or {}).get(
                    "quant_method"
                )
                or "mlx"
            )
            + ")"
        )
    return summary


def _folder_has_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").exists():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))
