"""Prompt-lookup drafts: guesses at a request's next tokens taken from its own context.

When the last few tokens of prompt + output occurred earlier in it, the tokens that
followed them then are a likely continuation now: an agent quoting a file it read, an edit
that rewrites most of a file unchanged, code repeating an identifier. The engine feeds such
a draft through the model with the request's next input in one row of the step (each
position's logits computed as a plain decode step would compute them) and keeps the longest
prefix the model would have produced anyway, plus the model's own token after it (for a
sampled request: the tokens its seeded draws choose at those positions, sampler.py). The
output is the same tokens with or without drafts; only the number of steps changes.

No torch here: the scheduler asks for drafts while planning.
"""

from __future__ import annotations

# Longest match first: a 4-token match predicts better than a 2-token one. Single tokens
# match too often by chance to be worth a row.
NGRAM_SIZES = (4, 3, 2)


class PromptLookup:
    """An index of where each n-gram of a token sequence last occurred with a known next
    token, kept up to date as the sequence grows (each token is indexed once)."""

    def __init__(self) -> None:
        # n-gram -> the position right after its latest occurrence that has a next token
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # positions e < this have their n-grams ending at e indexed

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        suffix of `tokens` (4, 3 or 2 tokens) found; [] when none occurred."""
        if limit <= 0:
            return []
        self._index(tokens)
        for n in NGRAM_SIZES:
            if len(tokens) <= n:
                continue
            after = self._after.get(tuple(tokens[-n:]))
            if after is not None:
                return tokens[after : after + limit]
        return []

    def _index(self, tokens: list[int]) -> None:
        # An n-gram ending at position e (exclusive) is indexed once token e exists, so the
        # suffix itself (no next token yet) never matches itself.
        last = len(tokens) - 1
        for e in range(max(self._indexed, 2), last + 1):
            for n in NGRAM_SIZES:
                if e >= n:
                    self._after[tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, last + 1)
