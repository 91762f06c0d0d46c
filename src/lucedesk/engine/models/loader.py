"""Loading a model from a GGUF file or a Hugging Face folder into a `LoadedModel`."""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lucedesk.catalog.gguf_header import SPLIT_NAME
from lucedesk.catalog.summary import file_type_name
from lucedesk.engine.models import tokenizer as tok
from lucedesk.engine.models.config import ModelConfig
from lucedesk.engine.models.decoder import DecoderModel
from lucedesk.engine.models.expert_weights import GGUFExperts, materialize_dense
from lucedesk.engine.models.families import BY_HF_TYPE, BY_NAME
from lucedesk.engine.models.family import Family
from lucedesk.engine.models.gguf_file import GGUFFile
from lucedesk.engine.models.harmony_tokens import ENDS as HARMONY_ENDS
from lucedesk.engine.models.harmony_tokens import MARKERS as HARMONY_MARKERS
from lucedesk.engine.models.harmony_tokens import is_harmony
from lucedesk.engine.models.weights import check_file_shapes, load_weights
from lucedesk.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    model: DecoderModel
    tokenizer: tok.Tokenizer
    config: ModelConfig
    path: Path
    name: str
    load_seconds: float
    quantization: str = ""  # GGUF file type (Q4_1, F16...) or the folder's torch_dtype


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    lazy_experts: bool = False,
    name: str | None = None,
    chat_template: str | None = None,
    read_weights: bool = True,
    lazy_weights: bool = False,
    lazy_embedding: bool = False,
) -> LoadedModel:
    """A `.gguf` file (a split model's first part) or a Hugging Face folder (config.json,
    *.safetensors, tokenizer.json); `name` is what it is called (default: the file's own
    name), `chat_template` the Jinja template its chats take instead of the file's.

    A GGUF mixture of experts keeps its expert weights in the file with `lazy_experts`
    until the engine picks their format (held_weights.apply_weight_format); otherwise they are
    read densely in `dtype` here. Without `read_weights` (a GGUF file whose held weights
    come from engine/weight_cache.py) the model's parameters are left unread. With
    `lazy_weights` a GGUF file's matmul weights (its projections and LM head) stay in the
    file too, their parameters empty, and with `lazy_embedding` its embedding table: the
    engine reads each alone once it knows their form (engine/held_weights.py)."""
    path = Path(path).expanduser()
    started = time.perf_counter()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    gguf = None
    if path.is_dir():
        config, weights, tokenizer = _read_hf_folder(path)
        quantization = _hf_dtype(path)
    elif path.suffix == ".gguf" or _has_gguf_magic(path):
        gguf = GGUFFile(path)
        config = gguf.model_config()
        tokenizer = tok.from_gguf(gguf)
        read = (not lazy_weights, not (lazy_weights and lazy_embedding))
        weights = gguf.weights(config, *read) if read_weights else None
        quantization = file_type_name(gguf.get("general.file_type"))
    else:
        raise ModelLoadError(f"{path}: neither a .gguf file nor a Hugging Face folder")
    if chat_template is not None:  # checked where it was read (catalog/settings.py)
        tokenizer.chat_template = chat_template
    name = name or name_of(path)
    _family_defaults(tokenizer, BY_NAME[config.architecture])
    model = DecoderModel(config, dtype)
    if gguf is not None:
        model.block_source = functools.partial(gguf.blocks, config)
        if config.is_moe:
            model.expert_source = GGUFExperts(gguf)
    if gguf is not None and read_weights and (lazy_weights or lazy_experts):
        check_file_shapes(model, gguf, str(path))  # what is left in the file, checked now
    if weights is not None:
        load_weights(model, weights, str(path), lazy=gguf is not None and lazy_weights)
    if model.expert_source is not None and not lazy_experts and weights is not None:
        materialize_dense(model)
    model.eval()
    seconds = time.perf_counter() - started
    return LoadedModel(model, tokenizer, config, path, name, seconds, quantization)


def name_of(path: Path) -> str:
    """A model's name from its path: the file's stem, a split model's without its part."""
    if path.is_dir():
        return path.name
    match = SPLIT_NAME.match(path.name)
    return match["prefix"] if match else path.stem


def _family_defaults(tokenizer: tok.Tokenizer, family: Family) -> None:
    """The family's chat template where the file has none, and its end-of-turn tokens; a
    harmony model's markers shown in its replies (harmony.py parses them)."""
    if tokenizer.chat_template is None and family.chat_template is not None:
        tokenizer.chat_template = family.chat_template
    if is_harmony(tokenizer.chat_template):
        markers = (tokenizer.token_to_id(m) for m in HARMONY_MARKERS)
        tokenizer.shown_special_ids = frozenset(i for i in markers if i is not None)
        # A reply ends at <|return|> (its answer) or <|call|> (a tool call); <|end|> only
        # ends one of its messages (files list it as an end of turn all the same).
        ends = [tokenizer.token_to_id(t) for t in HARMONY_ENDS]
        stops = [i for i in tokenizer.stop_token_ids if i != tokenizer.token_to_id("<|end|>")]
        tokenizer.stop_token_ids = tuple(dict.fromkeys(stops + [i for i in ends if i is not None]))
    extra = [tokenizer.token_to_id(t) for t in family.stop_tokens]
    tokenizer.stop_token_ids = tuple(
        dict.fromkeys([*tokenizer.stop_token_ids, *(i for i in extra if i is not None)])
    )


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
    if kind not in BY_HF_TYPE:
        raise ModelLoadError(
            f"{path}: unsupported model_type {kind!r} (supported: {', '.join(sorted(BY_HF_TYPE))})"
        )
    family = BY_HF_TYPE[kind]
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = raw.get("rope_parameters") or {}
        if "full_attention" in rope:  # one set per layer type: the family reads them
            rope = rope["full_attention"] or {}
        rope_scaling = raw.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        config = family.from_hf(
            raw,
            ModelConfig(
                architecture=family.name,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw.get("intermediate_size") or 0),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                name=folder.name,
            ),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: invalid value ({exc})") from None
    config.check(str(path))
    return config


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
    weights = BY_NAME[config.architecture].hf_weights(weights, config)
    return config, weights, tok.from_hf_folder(folder)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model's shape without loading its weights."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_dir():
        return hf_model_config(path)
    return GGUFFile(path).model_config()
