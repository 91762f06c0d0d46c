"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model = "llama"`, Gemma's), built
with the `tokenizers` library into the same tokenizer transformers builds from the file.

A GGUF file keeps the pieces, their scores and types, and no merges. The BPE merges are
recovered from the vocabulary: every piece that splits into two pieces is a merge, ranked by
where the piece stands in the file (Gemma's scores fall with the id, so this is also their
order). Pieces:
  - runs of 2-31 real spaces (user-defined) are respelled "▁▁..", as the text is normalized;
  - control tokens (<bos>, <start_of_turn>, ...) are special added tokens, user-defined ones
    (newline runs, html tags) plain added tokens, matched whole;
  - <0x00>..<0xFF> are the byte fallback.
Text is normalized " " -> "▁" (no prefix space: `add_space_prefix` is false in Gemma files)
and decoded back, bytes fused.

Recovering ~500k merges for a 262k vocabulary takes seconds, so the result is cached in the
user cache folder, keyed by a hash of the vocabulary.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from lucedesk.errors import ModelLoadError

if TYPE_CHECKING:
    from lucedesk.engine.models.gguf_file import GGUFFile

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("lucedesk")) / "tokenizers"


def recover_merges(vocab: dict[str, int], rank: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best-ranked piece first (lower rank better);
    within a piece by the ids of its halves; ties by the halves' lengths, longer first."""
    merges = []
    for piece, piece_rank in rank.items():
        local = [
            (piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend((piece_rank, a, b) for a, b in local)
    merges.sort(key=lambda m: (m[0], -len(m[1]), -len(m[2])))
    return [(a, b) for _, a, b in merges]


def from_gguf_sentencepiece(gguf: GGUFFile) -> HFTokenizer:
    """The file's SentencePiece vocabulary as a `tokenizers` Tokenizer (cached)."""
    if gguf.get("tokenizer.ggml.add_space_prefix", True):
        raise ModelLoadError(
            f"{gguf.path}: SentencePiece vocabularies with a prefix space (Llama 2, Mistral) "
            "are not built from GGUF metadata; Gemma's are"
        )
    tokens: list[str] = list(gguf.require("tokenizer.ggml.tokens"))
    types: list[int] = list(gguf.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    unk = gguf.get("tokenizer.ggml.unknown_token_id")
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", True))
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    digest = hashlib.sha256(
        "\0".join([*tokens, repr(types), repr((unk, bos, add_bos))]).encode(
            "utf-8", "surrogatepass"
        )
    ).hexdigest()[:24]
    cached = cache_dir() / f"spm-{digest}.json"
    if cached.exists():
        try:
            return HFTokenizer.from_file(str(cached))
        except Exception:  # a damaged cache entry is rebuilt
            log.warning("%s: cached tokenizer unreadable, rebuilding", cached)
    tokenizer = _build(tokens, types, unk, bos if add_bos else None)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cached.parent, suffix=".tmp", delete=False) as partial:
        pass
    try:
        tokenizer.save(partial.name)
        os.replace(partial.name, cached)  # atomic: a reader never sees half a file
    finally:
        Path(partial.name).unlink(missing_ok=True)
    return tokenizer


def _build(tokens: list[str], types: list[int], unk: int | None, bos: int | None) -> HFTokenizer:
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    rank = {t: i for i, t in enumerate(spelled)}
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=recover_merges(vocab, rank),
            fuse_unk=True,
            unk_token=spelled[unk] if unk is not None else None,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(spelled, types)
            if k == _CONTROL
        ]
    )
    # User-defined pieces as the file spells them; the respelled space runs are reached by
    # merges instead.
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == _USER_DEFINED and t in vocab
        ]
    )
    if bos is not None:
        name = spelled[bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{name}:0 $A:0",
            pair=f"{name}:0 $A:0 {name}:1 $B:1",
            special_tokens=[(name, bos)],
        )
    return backend
