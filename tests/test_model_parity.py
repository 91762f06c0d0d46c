"""Model code against transformers: tiny random llama, qwen2 and qwen3 checkpoints, fp32."""

from __future__ import annotations

import pytest
import torch

from lucedesk.engine.models.llama import CausalAttention
from lucedesk.engine.models.loader import load_model


def our_logits(loaded, ids: list[int]) -> torch.Tensor:
    x = torch.tensor(ids)
    attention = CausalAttention(loaded.config.head_dim)
    with torch.inference_mode():
        hidden = loaded.model(x, torch.arange(len(ids)), attention)
        return loaded.model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoint_logits_match_transformers(tiny_models, arch):
    import transformers

    folder = tiny_models[arch]
    ours = load_model(folder, torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    for length in (1, 7, 64, 300):
        ids = torch.randint(0, ours.config.vocab_size, (length,), generator=g).tolist()
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0]
        got = our_logits(ours, ids)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_config_families(tiny_models):
    assert load_model(tiny_models["qwen2"]).config.attention_bias
    assert load_model(tiny_models["qwen3"]).config.qk_norm
    assert not load_model(tiny_models["llama"]).config.tie_word_embeddings
    assert load_model(tiny_models["qwen3"]).config.tie_word_embeddings
