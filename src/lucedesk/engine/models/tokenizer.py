"""Tokenizers from tokenizer.json or from GGUF metadata, and streaming detokenization."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from lucedesk.errors import ModelLoadError, RequestError

if TYPE_CHECKING:
    from lucedesk.engine.models.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# Split patterns for the pre-tokenizers GGUF files name in tokenizer.ggml.pre (llama.cpp's
# names); each is the regex the vocabulary's merges were learned with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# gpt-4o's (o200k) split, which gpt-oss's vocabulary uses.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "gpt-4o": _GPT4O_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


# Texts this long are encoded without holding the GIL (~0.1 s of tokenizing and up).
LONG_TEXT = 16_384


@dataclass(slots=True)
class Tokenizer:
    """Encodes, decodes and knows the model's special tokens and chat template."""

    backend: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    # Token ids that end a generation (eos plus end-of-turn tokens from the model's metadata).
    stop_token_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] = field(default_factory=frozenset)
    # Special tokens a reply shows as text all the same: the markers of a format its text
    # is parsed by (gpt-oss's <|channel|>, <|message|>, ...; see harmony.py).
    shown_special_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            if len(text) < LONG_TEXT:
                return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
            # The batch call lets go of the GIL (the single one holds it for seconds on a
            # long prompt, stalling every other thread: the server's loop, the TUI).
            batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:  # a lone surrogate: text no encoding can write
            raise RequestError("the text is not valid Unicode (a lone surrogate)") from None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self.shown_special_ids:
            shown, special = self.shown_special_ids, self.special_ids
            ids = [i for i in ids if i in shown or i not in special]
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def detokenizer(self, prompt_ids: list[int] | None = None) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, list(prompt_ids or [])[-4:])


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never emitting half a UTF-8
    character: a delta is released only once decoding no longer ends in U+FFFD.

    Decoding a window of a few tokens before the new ones keeps spaces and byte-pieces right
    (tokenizers decode a token differently at the start of a string)."""

    def __init__(self, tokenizer: Tokenizer, context: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        # Decode the last emitted piece and the new tokens together; the difference is the
        # delta. The window stays a few tokens long, so a push costs O(1) in the text length.
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of a generation (a dangling byte piece)."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


def from_hf_folder(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc})") from None
    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")
    bos = _token_text(config.get("bos_token"))
    eos = _token_text(config.get("eos_token"))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    stops: list[int] = []
    gen_eos = generation.get("eos_token_id")
    if isinstance(gen_eos, int):
        stops.append(gen_eos)
    elif isinstance(gen_eos, list):
        stops.extend(int(i) for i in gen_eos)
    if eos is not None and backend.token_to_id(eos) is not None:
        stops.append(backend.token_to_id(eos))
    specials = frozenset(
        backend.token_to_id(t.content)
        for t in backend.get_added_tokens_decoder().values()
        if t.special
    )
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        chat_template=template,
        stop_token_ids=tuple(dict.fromkeys(stops)),
        special_ids=specials,
    )


def from_gguf(gguf: GGUFFile) -> Tokenizer:
    kind = gguf.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{gguf.path}: tokenizer model {kind!r} is not supported from GGUF metadata "
            "(supported: byte-level BPE 'gpt2', SentencePiece 'llama'); load the model's "
            "Hugging Face folder instead"
        )
    tokens: list[str] = list(gguf.require("tokenizer.ggml.tokens"))
    types: list[int] = list(gguf.get("tokenizer.ggml.token_type", []))
    if kind == "llama":
        from lucedesk.engine.models.sentencepiece import from_gguf_sentencepiece

        backend = from_gguf_sentencepiece(gguf)
    else:
        backend = _byte_level_bpe(gguf, tokens, types)

    def token(key: str) -> str | None:
        idx = gguf.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    stops = [
        int(gguf.get(f"tokenizer.ggml.{key}"))
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if gguf.get(f"tokenizer.ggml.{key}") is not None
    ]
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        chat_template=gguf.get("tokenizer.chat_template"),
        stop_token_ids=tuple(dict.fromkeys(stops)),
        special_ids=frozenset(i for i, t in enumerate(types) if t == _CONTROL),
    )


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pre = gguf.get("tokenizer.ggml.pre", "default")
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    )
    backend.pre_tokenizer = _pre_tokenizer(pre, gguf.path)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, t in zip(tokens, types)
            if t == _CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, t in zip(tokens, types)
            if t == _USER_DEFINED
        ]
    )
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    if (
        gguf.get("tokenizer.ggml.add_bos_token", False)
        and bos is not None
        and 0 <= bos < len(tokens)
    ):
        name = tokens[int(bos)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{name}:0 $A:0",
            pair=f"{name}:0 $A:0 {name}:1 $B:1",
            special_tokens=[(name, int(bos))],
        )
    return backend


def _pre_tokenizer(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's own tokenizer splits every digit before the GPT-2 byte-level split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in ("gpt-2", "default", "gpt2"):
        log.warning("%s: pre-tokenizer %r unknown, using GPT-2's split", path, pre)
    return byte_level


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: invalid JSON ({exc})") from None


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None
