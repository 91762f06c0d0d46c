"""Loading a model from a GGUF file or a Hugging Face folder into a `LoadedModel`."""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lucedesk.engine.models import tokenizer as tok
from lucedesk.engine.models.gguf_file import GGUFFile
from lucedesk.engine.models.llama import LlamaModel, ModelConfig, load_weights
from lucedesk.errors import ModelLoadError

log = logging.getLogger(__name__)

HF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: tok.Tokenizer
    config: ModelConfig
    path: Path
    name: str
    load_seconds: float
    quantization: str = ""  # GGUF file type (Q4_1, F16...) or the folder's torch_dtype


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A `.gguf` file or a Hugging Face folder (config.json, *.safetensors, tokenizer.json)."""
    path = Path(path).expanduser()
    started = time.perf_counter()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_dir():
        config, weights, tokenizer = _read_hf_folder(path)
        name = path.name
        quantization = _hf_dtype(path)
    elif path.suffix == ".gguf" or _has_gguf_magic(path):
        gguf = GGUFFile(path)
        config = gguf.model_config()
        tokenizer = tok.from_gguf(gguf)
        weights = gguf.weights(config)
        name = path.stem
        quantization = _gguf_file_type(gguf.get("general.file_type"))
    else:
        raise ModelLoadError(f"{path}: neither a .gguf file nor a Hugging Face folder")
    model = LlamaModel(config, dtype)
    load_weights(model, weights, str(path))
    if not path.is_dir():
        model.four_bit_source = functools.partial(gguf.four_bit, config)
    model.eval()
    seconds = time.perf_counter() - started
    return LoadedModel(model, tokenizer, config, path, name, seconds, quantization)


def _gguf_file_type(value: object) -> str:
    import gguf

    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return ""


def _hf_dtype(folder: Path) -> str:
    import json

    try:
        return str(json.loads((folder / "config.json").read_text()).get("torch_dtype") or "")
    except (OSError, ValueError):
        return ""


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def hf_model_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: invalid JSON ({exc})") from None
    kind = raw.get("model_type")
    if kind not in HF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported model_type {kind!r} "
            f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})"
        )
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        return ModelConfig(
            architecture=HF_ARCHITECTURES[kind],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=kind == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=kind == "qwen3",
            name=folder.name,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: invalid value ({exc})") from None


def _read_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], tok.Tokenizer]:
    from safetensors.torch import load_file

    config = hf_model_config(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: invalid index ({exc})") from None
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{f}: listed in the index but missing")
        try:
            weights.update(load_file(str(f)))
        except Exception as exc:
            raise ModelLoadError(f"{f}: cannot be read ({exc})") from None
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights, tok.from_hf_folder(folder)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model's shape without loading its weights."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_dir():
        return hf_model_config(path)
    return GGUFFile(path).model_config()
