"""GGUF loading: every supported tensor type, the q/k row permutation, tokenizer metadata,
checked against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucedesk.engine.models.loader import load_model
from tests.gguf_writer import write_gguf
from tests.test_model_parity import our_logits

MIXED = {
    "token_embd": Q.Q8_0,
    "output": Q.Q6_K,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q5_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.F16,
    "ffn_down": Q.BF16,
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return write_gguf(folder / "mixed.gguf", MIXED)


def test_every_quant_type_matches_transformers(mixed_gguf):
    import transformers

    ours = load_model(mixed_gguf, torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        mixed_gguf.parent, gguf_file=mixed_gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.randint(
        0, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0]
    got = our_logits(ours, ids.tolist())
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_gguf_tokenizer_matches_transformers(mixed_gguf):
    import transformers

    ours = load_model(mixed_gguf).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name)
    for text in ["hello world", "def add(a, b):\n    return a + b", "café 日本語 🙂", "  x  "]:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )
    assert ours.stop_token_ids == (ours.token_to_id("<|im_end|>"),)


def test_unpermute_inverts_llama_cpp_permutation():
    from lucedesk.engine.models.gguf_file import unpermute

    heads, head_dim, hidden = 3, 8, 5
    w = torch.randn(heads * head_dim, hidden)
    # llama.cpp's converter: interleave each head's two rotary halves.
    permuted = (
        w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(heads * head_dim, hidden)
    )
    assert torch.equal(unpermute(permuted, heads), w)
