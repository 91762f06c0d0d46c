"""Sampling the next token of each row, with one generator per request."""

from __future__ import annotations

import random

import torch

from lucedesk.engine.request import SamplingParams


class Sampler:
    """Greedy rows take the argmax; sampled rows apply temperature, top-k, top-p and min-p and
    draw with the request's own generator (seeded from `seed`), so a seeded request gets the
    same tokens whoever shares its batch."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def generator(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(seed if seed is not None else random.getrandbits(63))
            self._generators[request_id] = gen
        return gen

    @staticmethod
    def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        # logits: [vocab]; filtering order follows the common servers: top-k, top-p, min-p.
        logits = logits.float().cpu()
        logits = (logits - logits.max()) / p.temperature  # <= 0 everywhere: no overflow
        if 0 < p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly better tokens
            remove = before >= p.top_p
            remove[0] = False  # the best token always stays, however small top_p is
            sorted_probs[remove] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p > 0.0:
            probs[probs < p.min_p * probs.max()] = 0.0
        if not torch.isfinite(probs).all() or probs.sum() <= 0:
            raise ValueError("sampling produced no valid token (non-finite logits)")
        return int(torch.multinomial(probs, 1, generator=gen))
