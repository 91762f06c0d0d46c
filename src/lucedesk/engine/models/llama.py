"""The Llama family and its close kin: Llama 2/3 and SmolLM (`llama`), Qwen2 (q/k/v bias)
and Qwen3 (q/k norm). The decoder itself is decoder.py."""

from __future__ import annotations

from dataclasses import replace

from lucedesk.engine.models.family import Family

LLAMA = Family("llama", ("llama",), ("llama",), permuted_qk=True)
QWEN2 = Family(
    "qwen2",
    ("qwen2",),
    ("qwen2",),
    from_hf=lambda raw, c: replace(c, attention_bias=True),
    from_gguf=lambda gguf, c: replace(c, attention_bias=True),
)
QWEN3 = Family(
    "qwen3",
    ("qwen3",),
    ("qwen3",),
    from_hf=lambda raw, c: replace(c, qk_norm=True),
    from_gguf=lambda gguf, c: replace(c, qk_norm=True),
)
