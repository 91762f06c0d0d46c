"""Constrained decoding: what a request may ask its output to match (a JSON schema, a regex, a
Lark grammar) and the llguidance matchers that turn that into a token mask each step.

`Grammar` is plain data (no torch, no llguidance), so requests and the scheduler can carry it.
`GrammarCompiler` builds llguidance's tokenizer once from the tokenizer lucedesk loaded and
compiles a request's grammar into a matcher when the request is submitted; the sampler then
asks each matcher for its mask and feeds it the token that was chosen. A matcher depends only
on its own request's tokens, so batching cannot change what it allows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from lucedesk.errors import RequestError

if TYPE_CHECKING:
    import llguidance

    from lucedesk.engine.models.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "regex", "lark"]

# JSON as models are trained to write it (json.dumps' separators) and no free whitespace:
# flexible whitespace lets a small model pad a value with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PROBE_WALKS, PROBE_STEPS = 3, 16  # GrammarCompiler._probe


@dataclass(slots=True, frozen=True)
class Grammar:
    """What the output must match. `field` names the request field it came from, so an
    error can say which one is wrong (`response_format`, `tools[2].function.parameters`)."""

    kind: GrammarKind
    source: str
    field: str = "grammar"
    # The whole schema, when the grammar holds only part of it (chat/json_schema.py): the
    # output is checked against it after it is written.
    strict: str | None = None

    @classmethod
    def regex(cls, pattern: str, field: str = "grammar") -> Grammar:
        return cls("regex", pattern, field)

    @classmethod
    def lark(cls, source: str, field: str = "grammar") -> Grammar:
        return cls("lark", source, field)

    def to_llguidance(self) -> str:
        import llguidance

        if self.kind == "json_schema":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.source, defaults=JSON_OPTIONS
                )
            except ValueError as exc:
                raise RequestError(
                    f"{self.field}: invalid JSON schema ({exc})", self.field
                ) from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return llguidance.LLMatcher.grammar_from_lark(self.source)


class GrammarCompiler:
    """Compiles grammars against one tokenizer. llguidance's view of the vocabulary is built
    on first use (~0.2 s for a 49k vocabulary) and shared by every matcher after."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the width of the model's logits (may exceed the vocab)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        # Grammars already validated: an agent sends the same tools every turn, and a
        # chat's grammar is checked at encoding and compiled again at submission.
        self._checked: OrderedDict[tuple[str, str], str] = OrderedDict()
        # A fresh matcher per grammar; requests get copies (a copy costs microseconds, a
        # compile milliseconds for a few tools).
        self._fresh: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=list(self.tokenizer.stop_token_ids) or None,
                )
            return self._ll_tokenizer

    def check(self, grammar: Grammar) -> str:
        """The llguidance grammar for `grammar`; raises RequestError naming its field."""
        import llguidance

        key = (grammar.kind, grammar.source)
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return self._checked[key]
        compiled = grammar.to_llguidance()
        message = llguidance.LLMatcher.validate_grammar(compiled, self.ll_tokenizer)
        if not message or message.startswith("WARNING"):
            message = self._probe(compiled)
        if message and not message.startswith("WARNING"):
            raise RequestError(
                f"{grammar.field}: cannot be compiled ({short_error(message)})", grammar.field
            )
        with self._lock:
            self._checked[key] = compiled
            if len(self._checked) > 256:
                self._checked.popitem(last=False)
        return compiled

    def _probe(self, compiled: str) -> str | None:
        """The library's error on a few short random walks through the grammar, or None.
        Some grammars validate yet fail at their first tokens (a schema whose every value
        must nest without end: its parser runs out of room): they are refused with the
        request, not found out mid-reply. A few milliseconds, once per grammar."""
        import llguidance
        import numpy as np

        rng = np.random.default_rng(0)
        for _ in range(PROBE_WALKS):
            matcher = llguidance.LLMatcher(self.ll_tokenizer, compiled, log_level=0)
            for _ in range(PROBE_STEPS):
                mask = np.frombuffer(matcher.compute_bitmask(), np.uint8)
                if matcher.is_error():
                    return matcher.get_error()
                allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[: self.vocab_size])
                if matcher.is_stopped() or not len(allowed):
                    break
                matcher.consume_token(int(rng.choice(allowed)))
                if matcher.is_error():
                    return matcher.get_error()
        return None

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A matcher at the start of `grammar`, for one request."""
        import llguidance

        key = (grammar.kind, grammar.source)
        with self._lock:
            fresh = self._fresh.get(key)
            if fresh is not None:
                self._fresh.move_to_end(key)
                return fresh.deep_copy()
        fresh = llguidance.LLMatcher(self.ll_tokenizer, self.check(grammar), log_level=0)
        if not fresh.is_error() and not any(fresh.compute_bitmask()):
            raise RequestError(
                f"{grammar.field}: no output can match it (it allows no first token)",
                grammar.field,
            )
        if fresh.is_error():
            raise RequestError(
                f"{grammar.field}: cannot be compiled ({short_error(fresh.get_error())})",
                grammar.field,
            )
        with self._lock:
            self._fresh[key] = fresh
            if len(self._fresh) > 64:
                self._fresh.popitem(last=False)
        return fresh.deep_copy()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (special tokens as their text)."""
        if token_id in self.tokenizer.special_ids:
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return self.ll_tokenizer.decode_bytes([token_id])


def short_error(message: str, limit: int = 200) -> str:
    """The grammar library's message without its state dump (from `<state>` on): its
    meaningful lines, joined, at most `limit` characters."""
    lines = [line.strip() for line in message.split("<state>")[0].strip().splitlines()]
    text = " ".join(line for line in lines if line and set(line) != {"^"})
    return text if len(text) <= limit else text[: limit - 3] + "..."
