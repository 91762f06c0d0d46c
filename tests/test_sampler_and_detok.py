"""Sampling filters, the greedy choice and streaming detokenization."""

from __future__ import annotations

import itertools

import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import Request, SamplingParams
from lucedesk.engine.sampler import Sampler, nucleus, uniform
from lucedesk.kernels.cpu import greedy_cpu
from lucedesk.kernels.layers_torch import greedy_torch


def spread(n: int) -> list[float]:
    """n numbers spread evenly over [0, 1): each token of probability p is drawn ~p * n times."""
    return [(i + 0.5) / n for i in range(n)]


def draws(logits, params, n=400):
    return {Sampler.sample_row(logits, params, u) for u in spread(n)}


def test_top_k_keeps_the_k_best():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    assert draws(logits, SamplingParams(temperature=5.0, top_k=2)) == {0, 1}


def test_top_p_keeps_the_smallest_set_covering_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}
    assert draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.5)) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert draws(probs.log(), SamplingParams(temperature=1.0, min_p=0.5)) == {0, 1}


def test_draws_follow_the_distribution():
    """The token where u falls in the cumulative distribution: over evenly spread u, each
    token comes as often as its probability says (to one draw in 1,000)."""
    g = torch.Generator().manual_seed(0)
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=20, min_p=0.01),
    ):
        logits = torch.randn(300, generator=g) * 3
        counts = torch.zeros(300)
        for u in spread(1000):
            counts[Sampler.sample_row(logits, params, u)] += 1
        probs = torch.softmax(logits / params.temperature, -1)
        if params.top_k:
            probs[probs < torch.topk(probs, params.top_k).values[-1]] = 0
        if params.top_p < 1:
            probs = nucleus(probs / probs.sum(), params.top_p)
        if params.min_p:
            probs[probs < params.min_p * probs.max()] = 0
        probs /= probs.sum()
        assert (counts / 1000 - probs).abs().max() <= 1.5e-3
        assert counts[probs == 0].sum() == 0


def test_nucleus_without_sorting_everything_matches_a_full_sort():
    g = torch.Generator().manual_seed(1)
    for scale in (0.5, 2.0, 8.0):  # flat (a full sort) to peaked (the first look suffices)
        probs = torch.softmax(torch.randn(5000, generator=g) * scale, -1)
        for top_p in (0.1, 0.5, 0.9, 0.99):
            values, order = probs.sort(descending=True)
            before = values.cumsum(0) - values
            keep = before < top_p
            keep[0] = True
            want = torch.zeros_like(probs).scatter_(0, order[keep], values[keep])
            assert torch.equal(nucleus(probs, top_p), want)


def test_seed_reproduces_and_differs():
    """A draw is fixed by the seed and the token's position, nothing else."""
    assert uniform(7, 3) == uniform(7, 3)
    assert len({uniform(7, i) for i in range(100)}) == 100
    assert uniform(7, 3) != uniform(8, 3)
    assert all(0 <= uniform(s, i) < 1 for s in (0, 2**64 - 1) for i in range(50))
    sampler = Sampler()
    assert sampler.base("x", 7) == sampler.base("y", 7) == 7
    assert sampler.base("z", -1) == 2**64 - 1  # negative seeds wrap, as 64-bit seeds do
    assert sampler.base("r1", None) != sampler.base("r2", None)


def test_incremental_detokenizer_never_splits_characters(tiny_llama):
    tok = load_model(tiny_llama).tokenizer
    text = "café 日本語 🙂🚀 naïve\n  def f(): return 42"
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer()
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_tiny_temperature_and_top_p_stay_valid():
    logits = torch.tensor([3.0, 1.0, -2.0, 50.0])
    for params in (
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=2e-5),
        SamplingParams(temperature=1.0, top_p=1e-300),
        SamplingParams(temperature=100.0, top_k=1),
    ):
        assert params.greedy or Sampler.sample_row(logits, params, 0.5) == 3
    assert SamplingParams(temperature=1e-300).greedy


def awkward_logits(g: torch.Generator, rows: int, vocab: int, kind: int) -> torch.Tensor:
    """Few distinct values (ties everywhere), with +-inf and -0 among them; NaN too (kind 0),
    or none and a maximum of 0 (kind 1, -0 and +0 tied at it), or none (kind 2)."""
    x = torch.randint(-3, 1 if kind == 1 else 4, (rows, vocab), generator=g).float()
    u = torch.rand(rows, vocab, generator=g)
    if kind == 0:
        x[u < 0.02] = float("nan")
    if kind != 1:
        x[(u >= 0.02) & (u < 0.04)] = float("inf")
    x[(u >= 0.04) & (u < 0.1)] = float("-inf")
    x[(u >= 0.1) & (u < 0.2)] = -0.0
    return x


def test_the_cpu_greedy_choice_is_torch_argmax():
    # First maximum, a NaN above all; vocabularies around the vector width's tails, rows
    # that split between threads, every entry -inf, rows with a stride.
    g = torch.Generator().manual_seed(0)
    cases = [(rows, vocab) for rows in (1, 3, 40) for vocab in (1, 15, 16, 17, 33, 257)]
    cases += [(1, 49152), (16, 49152), (2, 151936)]
    for rep, (rows, vocab) in itertools.product(range(20), cases):
        x = awkward_logits(g, rows, vocab, rep % 3)
        if rep % 4 == 1:
            x[rows // 2] = float("-inf")
        if rep % 5 == 2:
            x[:, : vocab // 2] = float("-inf")  # the maximum late in the row
        views = [x, x[:, : max(1, vocab - 1)], x[::2]]
        for logits in views:
            assert torch.equal(greedy_cpu(logits), greedy_torch(logits)), (rep, logits)
    assert greedy_cpu(torch.empty(0, 8)).shape == (0,)
    assert greedy_cpu(torch.randn(1, 3).t()).tolist() == [0, 0, 0]  # a vocabulary of one


def test_the_sampler_chooses_greedy_rows_with_the_kernels_choice():
    logits = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 9.0, float("nan")]])
    asked = []

    def greedy(rows: torch.Tensor) -> torch.Tensor:
        asked.append(rows.shape[0])
        return greedy_cpu(rows)

    sampler = Sampler(greedy)
    reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=2, temperature=0)) for i in (0, 1)]
    for slot, req in enumerate(reqs):
        req.slot = slot
    assert sampler.sample(logits, reqs).sampled == {0: 1, 1: 0}
    assert sampler.choose(logits[0], reqs[0], 1) == 1
    assert sampler.verify(logits, reqs[0], (1,)) == ((1,), 0, False)
    assert asked == [2, 1, 2]
