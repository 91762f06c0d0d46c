"""What a model file says of itself without loading it: its architecture, parameters, quant,
size, context and the shape its KV cache takes. Read from a GGUF header or from a Hugging
Face folder's config.json and safetensors headers; the engine sizes memory from it."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from lucedesk.catalog.gguf_header import Header, read_header, split_parts
from lucedesk.errors import ModelLoadError

# GGUF tensor types whose blocks a 4-bit weight holds as they are (gguf_blocks.FOUR_BIT_TYPES,
# and a mixture's MXFP4 experts); with the 5-bit ones, the types whose files the engine
# holds as 4-bit weights (gguf_blocks.LOW_BIT_TYPES: 5-bit blocks at 8 bits). Q6_K blocks
# are held at 6 bits, about their own size too.
FOUR_BIT_TENSOR_TYPES = ("Q4_0", "Q4_1", "Q4_K", "MXFP4")
LOW_BIT_TENSOR_TYPES = (*FOUR_BIT_TENSOR_TYPES, "Q5_0", "Q5_1")
HELD_AS_IS_TYPES = (*FOUR_BIT_TENSOR_TYPES, "Q6_K")


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
    low_bit: bool  # its first layer's MLP is in a 4- or 5-bit type (the engine's q4 rule)
    # Its matmul weights and LM head (a tied one too) as 4-bit weights hold them: 4-bit
    # blocks as stored, others at 8 bits (1.125 bytes a weight); 0: no tensor table read.
    low_bit_bytes: int = 0
    tensor_types: tuple[str, ...] = ()  # GGML's names of the types its tensors are in
    name: str = ""  # what the file calls the model (general.name), if anything
    chat_template: bool = True  # the file carries one

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

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
    matmuls = [t for t in tensors if len(t.shape) >= 2 and t.name != "token_embd.weight"]

    def as_low_bit(t) -> int:
        return t.nbytes if t.type_name in HELD_AS_IS_TYPES else t.numel * 9 // 8

    held = sum(as_low_bit(t) for t in matmuls)
    embedding = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if "output.weight" not in names and embedding is not None:
        held += as_low_bit(embedding)  # the tied LM head, held from the embedding's blocks
    first_mlp = next(
        (t for t in tensors if t.name in ("blk.0.ffn_gate.weight", "blk.0.ffn_gate_exps.weight")),
        None,
    )
    declared = int(meta.get("split.tensors.count", len(tensors)))
    params = sum(t.numel for t in tensors)
    if declared > len(tensors):  # a split model's first part alone: scale by its bytes
        share = size_bytes / (sum(t.nbytes for t in tensors) or 1)
        params, held = int(params * share), int(held * share)
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
        low_bit=first_mlp is not None and first_mlp.type_name in LOW_BIT_TENSOR_TYPES,
        low_bit_bytes=held,
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
            low_bit=False,
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
