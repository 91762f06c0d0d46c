"""The real Gemma 3 270M file (GGUF Q4_K_M, as PyPI's chunk wheels carry it) against
transformers loading the same file: its SentencePiece vocabulary built from the GGUF
metadata, the family's defaults where the file is silent, and greedy continuations."""

from __future__ import annotations

import pytest
import torch

from lucedesk.chat.template import render_chat
from lucedesk.engine.models.loader import load_model
from tests.test_default_model import assert_greedy_matches, varied_strings

pytestmark = pytest.mark.gemma3_file

GEMMA_STRINGS = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a written bos",
    "two  spaces, three   and    four",
    "\n\n\n\n\n\n\n\n",
    "\t\t\tindented with tabs",
    "<b>bold</b> <unused0> [multimodal]",
    "unknown bytes \u0000\u0007 and \ufffd",
]


@pytest.fixture(scope="module")
def ours(gemma_model):
    return load_model(gemma_model, torch.float32)


@pytest.fixture(scope="module")
def reference(gemma_model):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(gemma_model.parent, gguf_file=gemma_model.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_model.parent, gguf_file=gemma_model.name, dtype=torch.float32
    ).eval()
    return tok, model


def test_the_file_is_gemma3(ours):
    c = ours.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.head_dim) == ("gemma3", 18, 640, 256)
    assert c.layer_types.count("full") == 3 and c.sliding_window == 512
    assert c.rope_local_theta == 10000.0 and c.rope_theta == 1_000_000.0


def test_tokenizer_matches_transformers(ours, reference):
    ref_tok, _ = reference
    strings = varied_strings() + GEMMA_STRINGS
    for s in strings:
        ids = ours.tokenizer.encode(s)
        assert ids == ref_tok(s)["input_ids"], repr(s)
        assert ours.tokenizer.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True), repr(s)
    assert ours.tokenizer.encode("hi")[0] == ours.tokenizer.token_to_id("<bos>")


def test_the_family_supplies_what_the_file_leaves_out(ours):
    """The file has no chat template and names only <eos> as an end: Gemma's turn format and
    <end_of_turn> stand in, as Gemma's own tokenizer config has them."""
    tok = ours.tokenizer
    assert tok.token_to_id("<end_of_turn>") in tok.stop_token_ids
    assert tok.token_to_id("<eos>") in tok.stop_token_ids
    text = render_chat(
        tok,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\nx = np.",
]


def test_greedy_continuations_match_transformers(ours, reference):
    """Batched in the engine (fp32, the prompts past no window: the engine's windows are
    checked on tiny checkpoints), token for token as transformers generates alone; a
    divergence is allowed only where transformers' top two are a near-tie."""
    from lucedesk.config import EngineConfig
    from lucedesk.engine.build import assemble
    from lucedesk.engine.request import SamplingParams

    _, ref_model = reference
    engine = assemble(ours, EngineConfig(max_slots=6, kv_pool_tokens=4096), torch.device("cpu"))
    engine = engine.engine.start()
    try:
        prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
        params = SamplingParams(max_tokens=32, temperature=0.0)
        handles = [engine.submit(p, params) for p in prompts]
        got = [h.result(timeout=600).token_ids for h in handles]
    finally:
        engine.shutdown()
    assert_greedy_matches(ref_model, prompts, got, list(ours.tokenizer.stop_token_ids), 32)


def test_q4_holds_the_files_blocks_as_they_are(gemma_model, ours):
    """`q4` (what `auto` takes where the VNNI kernels run): the Q5_0 and Q8_0
    projections and the Q8_0 LM head as 8-bit levels with the file's float16 scales, the
    Q4_K ones at 4 bits, the Q6_K down projections at 6 bits; its next-token predictions
    over a text stay the float32 model's."""
    from lucedesk.engine.build import apply_weight_format
    from lucedesk.engine.models.causal_attention import CausalAttention
    from lucedesk.kernels.quantized import lowbit_vector_available

    held = load_model(gemma_model, torch.bfloat16)
    model = held.model
    wanted = "auto" if lowbit_vector_available() else "q4"
    assert apply_weight_format(model, wanted, "cpu") == "q4"
    for i, layer in enumerate(model.layers):
        for proj, weight in layer.quantized.items():
            types = set(model.block_source(i, proj).types)
            if types <= {"Q5_0", "Q8_0"}:
                assert (weight.bits, weight.d.dtype) == (8, torch.float16), (i, proj)
            elif types == {"Q4_K"}:
                assert weight.bits == 4, (i, proj)
            else:
                assert types == {"Q6_K"} and weight.bits == 6, (i, proj)
    assert (model.lm_head_quantized.bits, model.lm_head_quantized.d.dtype) == (8, torch.float16)

    text = " ".join(PROMPTS) + " The quick brown fox jumps over the lazy dog. " * 3
    ids = torch.tensor(ours.tokenizer.encode(text))
    with torch.inference_mode():
        predicted = [
            m.compute_logits(m(ids, torch.arange(len(ids)), CausalAttention(c))).argmax(-1)
            for m, c in ((ours.model, ours.config), (model, held.config))
        ]
    assert len(ids) >= 60
    assert (predicted[0] == predicted[1]).float().mean() >= 0.9
