"""Every model family lucedesk loads, found by what its files call it."""

from __future__ import annotations

from lucedesk.engine.models.gemma3 import GEMMA3
from lucedesk.engine.models.gpt_oss import GPT_OSS
from lucedesk.engine.models.llama import LLAMA, QWEN2, QWEN3
from lucedesk.engine.models.qwen3_moe import QWEN3_MOE

FAMILIES = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, GPT_OSS, GEMMA3)
BY_HF_TYPE = {t: f for f in FAMILIES for t in f.hf_types}
BY_GGUF_ARCH = {a: f for f in FAMILIES for a in f.gguf_archs}
BY_NAME = {f.name: f for f in FAMILIES}
