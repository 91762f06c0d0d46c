"""Model code against transformers: tiny random checkpoints of every family, fp32, at prompt
lengths from 1 to 300 (past the sliding window of the families that have one)."""

from __future__ import annotations

import pytest
import torch

from lucedesk.engine.models.causal_attention import CausalAttention
from lucedesk.engine.models.loader import load_model
from tests.conftest import DENSE_ARCHS, NEW_ARCHS

LENGTHS = (1, 7, 64, 300)


def our_logits(loaded, ids: list[int]) -> torch.Tensor:
    x = torch.tensor(ids)
    attention = CausalAttention(loaded.config)
    with torch.inference_mode():
        hidden = loaded.model(x, torch.arange(len(ids)), attention)
        return loaded.model.compute_logits(hidden)


def reference_model(folder):
    """transformers' own model for a checkpoint, with its plain (eager) attention: the one
    path of it that implements sinks and sliding windows for every family."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def assert_logits_match(ours, ref, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for length in LENGTHS:
        ids = torch.randint(0, ours.config.vocab_size, (length,), generator=g).tolist()
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0]
        got = our_logits(ours, ids)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", DENSE_ARCHS + NEW_ARCHS)
def test_tiny_checkpoint_logits_match_transformers(tiny_models, arch):
    folder = tiny_models[arch]
    assert_logits_match(load_model(folder, torch.float32), reference_model(folder))


def test_config_families(tiny_models):
    assert load_model(tiny_models["qwen2"]).config.attention_bias
    assert load_model(tiny_models["qwen3"]).config.qk_norm
    assert not load_model(tiny_models["llama"]).config.tie_word_embeddings
    assert load_model(tiny_models["qwen3"]).config.tie_word_embeddings
    moe = load_model(tiny_models["qwen3moe"]).config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.dense_layers) == (8, 2, (1,))
    oss = load_model(tiny_models["gpt-oss"]).config
    assert oss.layer_types == ("sliding", "full") and oss.attention_sinks
    assert oss.router == "topk_softmax" and oss.rope_scaling["rope_type"] == "yarn"
    gemma = load_model(tiny_models["gemma3"]).config
    assert gemma.layer_types == ("sliding",) * 5 + ("full",)
    assert gemma.sandwich_norms and gemma.attention_scale == 24**-0.5
