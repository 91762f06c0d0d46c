"""Sampling filters and streaming detokenization."""

from __future__ import annotations

import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import SamplingParams
from lucedesk.engine.sampler import Sampler


def draws(logits, params, n=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {Sampler.sample_row(logits, params, gen) for _ in range(n)}


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


def test_seed_reproduces_and_differs():
    logits = torch.randn(100)
    p = SamplingParams(temperature=1.0)
    a = [Sampler.sample_row(logits, p, torch.Generator().manual_seed(3)) for _ in range(1)]
    b = [Sampler.sample_row(logits, p, torch.Generator().manual_seed(3)) for _ in range(1)]
    assert a == b
    sampler = Sampler()
    g1, g2 = sampler.generator("x", 7), sampler.generator("y", 7)
    seq1 = [Sampler.sample_row(logits, p, g1) for _ in range(20)]
    seq2 = [Sampler.sample_row(logits, p, g2) for _ in range(20)]
    assert seq1 == seq2


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
        gen = torch.Generator().manual_seed(0)
        assert params.greedy or Sampler.sample_row(logits, params, gen) == 3
    assert SamplingParams(temperature=1e-300).greedy
