"""Choosing each row's next token: grammar masks, greedy or sampled, logprobs, and the
grammar matchers fed with what was chosen. One entry point, `Sampler.sample`."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from lucedesk.engine.grammar import short_error
from lucedesk.engine.handle import TokenLogprob
from lucedesk.engine.request import Request, SamplingParams
from lucedesk.engine.seq_engine import StepResult
from lucedesk.kernels.layers_torch import greedy_torch

MASK64 = (1 << 64) - 1
NUCLEUS_FIRST_LOOK = 64  # top-p looks at this many best tokens before sorting them all


def uniform(base: int, position: int) -> float:
    """A number in [0, 1) fixed by a request's base seed and the position of the token being
    chosen (splitmix64 of the two): a request's draw for a position is the same however its
    tokens were grouped into steps, batched, preempted or drafted."""
    z = (base + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


class Sampler:
    """Greedy rows take the argmax; sampled rows apply temperature, top-k, top-p and min-p and
    take the token where a uniform number falls in the cumulative distribution, the number
    fixed by the request's seed and the token's position: a seeded request gets the same
    tokens whoever shares its batch, and a draft checked position by position gets the
    tokens it would get without one. Rows with a grammar are masked first; rows without one
    pay nothing for it."""

    def __init__(self, greedy: Callable[[torch.Tensor], torch.Tensor] = greedy_torch) -> None:
        self.greedy = greedy  # logits [R, vocab] -> each row's argmax (the kernels' own)
        self._bases: dict[str, int] = {}  # request -> base seed of its draws
        self._executor = None  # llguidance's thread pool, made at the first grammar row
        self._shifts = torch.arange(32, dtype=torch.int32)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._bases.pop(rid, None)

    def base(self, request_id: str, seed: int | None) -> int:
        base = self._bases.get(request_id)
        if base is None:
            base = seed & MASK64 if seed is not None else random.getrandbits(64)
            self._bases[request_id] = base
        return base

    def choose(self, logits: torch.Tensor, req: Request, position: int) -> int:
        """The token at `position` of prompt + output from its logits [vocab] (no grammar)."""
        p = req.params
        if p.greedy:
            return int(self.greedy(logits[None])[0])
        return self.sample_row(logits, p, uniform(self.base(req.request_id, p.seed), position))

    def verify(
        self, logits: torch.Tensor, req: Request, draft: tuple[int, ...]
    ) -> tuple[tuple[int, ...], int, bool]:
        """A draft row's outcome: logits [len(draft) + 1, vocab] for the row's input and each
        draft token. Returns (the draft tokens kept, the token after them, whether the
        grammar is complete with it): the longest prefix of the draft that the tokens
        chosen position by position agree with, as choosing without a draft would have
        chosen them. For a sampled row this is the standard rule for a draft of fixed
        tokens: draft token d is kept with probability p(d), and otherwise the token is
        drawn from p without d. A grammar row is masked and fed one position at a time."""
        n = req.num_tokens
        if req.matcher is None and req.params.greedy:
            greedy = self.greedy(logits).tolist()
            kept = 0
            while kept < len(draft) and draft[kept] == greedy[kept]:
                kept += 1
            return draft[:kept], greedy[kept], False
        for j in range(len(draft) + 1):
            row = logits[j : j + 1]
            if req.matcher is not None:
                errors: dict[int, str] = {}
                row = row.clone()
                self._apply_masks(row, [req], [0], errors)
                if errors:
                    raise ValueError(errors[req.slot])
            token = self.choose(row[0], req, n + j)
            stopped = False
            if req.matcher is not None:
                if not req.matcher.consume_token(token) or req.matcher.is_error():
                    raise ValueError(
                        f"grammar rejected token {token}: {short_error(req.matcher.get_error())}"
                    )
                stopped = req.matcher.is_stopped()
            if stopped or j == len(draft) or token != draft[j]:
                return draft[:j], token, stopped
        raise AssertionError("unreachable")

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> StepResult:
        """logits: [R, vocab], row i belonging to requests[i] (each holding a slot)."""
        errors: dict[int, str] = {}
        wants_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        # Logprobs are the model's own distribution: taken before masks and temperature.
        logprobs = torch.log_softmax(logits[wants_logprobs].float(), -1) if wants_logprobs else None
        constrained = [i for i, r in enumerate(requests) if r.matcher is not None]
        if constrained:
            self._apply_masks(logits, requests, constrained, errors)
        greedy = self.greedy(logits).tolist()
        sampled: dict[int, int] = {}
        for i, req in enumerate(requests):
            if req.slot in errors:
                continue
            p = req.params
            if p.greedy:
                sampled[req.slot] = greedy[i]
                continue
            try:
                sampled[req.slot] = self.choose(logits[i], req, req.num_tokens)
            except Exception as exc:  # one bad row must not sink the batch
                errors[req.slot] = f"sampling failed: {exc}"
        found: dict[int, TokenLogprob] = {}
        if logprobs is not None:
            found = self._gather_logprobs(logprobs, [requests[i] for i in wants_logprobs], sampled)
        stopped = self._advance_matchers([requests[i] for i in constrained], sampled, errors)
        return StepResult(sampled, errors, found, stopped)

    def _apply_masks(
        self, logits: torch.Tensor, requests: list[Request], rows: list[int], errors: dict
    ) -> None:
        """Sets every token the row's grammar forbids to -inf; a row whose grammar allows
        nothing fails alone."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        vocab = logits.shape[1]
        words = (vocab + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        # llguidance fills every row's mask at once, on its own threads without the GIL.
        self._executor.unsafe_compute_mask_ptr(
            [(requests[i].matcher, k) for k, i in enumerate(rows)],
            bitmask.data_ptr(),
            words * 4,
            len(rows),
        )
        bitmask[:, vocab // 32 + 1 :] = 0  # words wholly past the logits
        if vocab % 32:
            bitmask[:, vocab // 32] &= (1 << (vocab % 32)) - 1
        for k, i in enumerate(rows):
            req = requests[i]
            if req.params.ignore_eos and req.end_ids:
                _forbid_unless_alone(bitmask[k], req.end_ids)
            if req.matcher.is_error():
                errors[req.slot] = f"grammar failed: {short_error(req.matcher.get_error())}"
            elif not bool(bitmask[k].any()):
                errors[req.slot] = "the grammar allows no next token"
        # bit j of word w allows token 32*w + j; unpacked where the logits are
        packed = bitmask.to(logits.device)
        shifts = self._shifts.to(logits.device)
        allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor, requests: list[Request], sampled: dict[int, int]
    ) -> dict[int, TokenLogprob]:
        out: dict[int, TokenLogprob] = {}
        for k, req in enumerate(requests):
            token = sampled.get(req.slot)
            if token is None:
                continue
            top: tuple[tuple[int, float], ...] = ()
            if req.params.logprobs:
                values, ids = torch.topk(logprobs[k], req.params.logprobs)
                top = tuple(zip(ids.tolist(), values.tolist()))
            out[req.slot] = TokenLogprob(token, float(logprobs[k, token]), top)
        return out

    @staticmethod
    def _advance_matchers(
        requests: list[Request], sampled: dict[int, int], errors: dict[int, str]
    ) -> frozenset[int]:
        """Feeds each grammar the token chosen for it; returns the slots whose grammar is
        complete (the request ends there)."""
        stopped = set()
        for req in requests:
            token = sampled.get(req.slot)
            if token is None:
                continue
            matcher = req.matcher
            if not matcher.consume_token(token) or matcher.is_error():
                errors[req.slot] = (
                    f"grammar rejected token {token}: {short_error(matcher.get_error())}"
                )
                del sampled[req.slot]
            elif matcher.is_stopped():
                stopped.add(req.slot)
        return frozenset(stopped)

    @staticmethod
    def sample_row(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
        """logits: [vocab] -> the token where `u` (in [0, 1)) falls in the cumulative
        distribution, in vocabulary order, after temperature and the filters; filtering
        order follows the common servers: top-k, top-p, min-p."""
        logits = logits.float().cpu()
        logits = (logits - logits.max()) / p.temperature  # <= 0 everywhere: no overflow
        if 0 < p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            probs = nucleus(probs, p.top_p)
        if p.min_p > 0.0:
            probs[probs < p.min_p * probs.max()] = 0.0
        if not torch.isfinite(probs).all() or probs.sum() <= 0:
            raise ValueError("sampling produced no valid token (non-finite logits)")
        cdf = probs.cumsum(0)
        index = int(torch.searchsorted(cdf, cdf[-1] * u, right=True))
        return min(index, probs.shape[0] - 1)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs with every token outside the smallest set of best tokens whose mass reaches
    top_p set to 0 (the best token always stays). The best few are looked at first: when
    they hold top_p, the rest cannot be in the set, and nothing needs sorting."""
    k = min(NUCLEUS_FIRST_LOOK, probs.shape[0])
    values, order = torch.topk(probs, k)
    if k < probs.shape[0] and float(values.sum()) < top_p:
        values, order = probs.sort(descending=True)
    before = values.cumsum(0) - values  # mass of strictly better tokens
    keep = before < top_p
    keep[0] = True  # the best token always stays, however small top_p is
    return torch.zeros_like(probs).scatter_(0, order[keep], values[keep])


def _forbid_unless_alone(words: torch.Tensor, token_ids: frozenset[int]) -> None:
    """Clears the bits of `token_ids` in one packed mask row unless nothing else is allowed
    (`ignore_eos`: a grammar that may end does not end the request early; one that must end
    still does)."""
    kept = words.clone()
    one = torch.tensor(1, dtype=torch.int32)
    for t in token_ids:
        if t // 32 < kept.numel():
            kept[t // 32] &= ~(one << (t % 32))
    if bool(kept.any()):
        words.copy_(kept)
