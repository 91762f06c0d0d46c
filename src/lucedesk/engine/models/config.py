"""A model's shape, family-neutral: what the decoder, the KV pool and the loaders agree on,
and the rotary tables it implies (default, linear, llama3, YaRN)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# How a layer attends: to every earlier token, or to the last `sliding_window` of them.
FULL, SLIDING = "full", "sliding"
# The MLP's gate activation, applied to gate and up halves of the fused gate|up output.
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")
# How a mixture-of-experts router turns logits into the weights of the top-k experts:
# softmax over all experts, then the top k (renormalized with `norm_topk_prob`), or the top
# k logits, then a softmax over those k.
ROUTERS = ("softmax_topk", "topk_softmax")


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # llama | qwen2 | qwen3 | qwen3moe | gpt-oss | gemma3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling dict ({"rope_type": "llama3" | "linear" | "yarn", ...}) or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k and v (qwen2, gpt-oss)
    o_proj_bias: bool = False  # and on the attention output (gpt-oss)
    qk_norm: bool = False  # RMSNorm over each head of q and k (qwen3, gemma3)
    name: str = ""
    # -- attention variants --
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; empty = all FULL
    sliding_window: int = 0  # keys a SLIDING layer sees, its own position included
    # Rotary base of the SLIDING layers when it differs (gemma3: 10,000 locally, 1e6 for the
    # full layers); 0 = rope_theta. Sliding layers never take the rope scaling.
    rope_local_theta: float = 0.0
    attention_sinks: bool = False  # a learned logit per head in each softmax (gpt-oss)
    query_pre_attn_scalar: float = 0.0  # attention scale is its -1/2 power; 0 = head_dim
    # -- block variants (gemma3) --
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too
    # Norm weights kept in float32 and multiplied before rounding (gemma3's (1 + w), gpt-oss)
    float32_norms: bool = False
    embedding_scale: float = 1.0  # embeddings are multiplied by this (in the model dtype)
    hidden_act: str = "silu"
    # -- mixture of experts --
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    expert_bias: bool = False  # router and expert biases (gpt-oss)
    swiglu_limit: float = 7.0  # swiglu_clamped: gate <= limit, |up| <= limit
    swiglu_alpha: float = 1.702
    extra: dict = field(default_factory=dict)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    def window(self, layer: int) -> int:
        """Keys a layer's rows see (0 = all)."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def check(self, source: str) -> None:
        """Raises ModelLoadError naming `source` for values no family here runs."""
        from lucedesk.errors import ModelLoadError

        problems = []
        if self.layer_types and len(self.layer_types) != self.num_layers:
            problems.append(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if any(t not in (FULL, SLIDING) for t in self.layer_types):
            problems.append(f"layer types must be {FULL} or {SLIDING}")
        if SLIDING in self.layer_types and self.sliding_window < 1:
            problems.append("sliding layers without a sliding window")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.num_experts:
            if self.router not in ROUTERS:
                problems.append(f"router {self.router!r}")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                problems.append(
                    f"{self.num_experts_per_tok} experts per token of {self.num_experts}"
                )
            if self.moe_intermediate_size < 1:
                problems.append("no expert feed-forward length")
        if self.intermediate_size < 1 and any(
            not self.is_moe_layer(i) for i in range(self.num_layers)
        ):
            problems.append("no feed-forward length for the dense MLP layers")
        if self.num_heads % max(self.num_kv_heads, 1):
            problems.append(f"{self.num_heads} heads do not group over {self.num_kv_heads}")
        if problems:
            raise ModelLoadError(f"{source}: unsupported model shape: {'; '.join(problems)}")


def rope_inv_freq(
    config: ModelConfig, theta: float | None = None, scaling: dict | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] for base `theta` (default: the config's) and the
    factor cos and sin are multiplied by (YaRN's attention factor, else 1)."""
    dim = config.head_dim
    base = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":  # GGUF's rope_freqs tensor: llama.cpp divides theta by it
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind == "yarn":
        return _yarn(dim, base, scaling)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq.float(), 1.0


def _yarn(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN as transformers computes it (float32, as its reference does): each frequency
    blends the original (extrapolated) and the divided-by-factor (interpolated) one by a
    linear ramp between two correction dimensions; cos/sin are scaled by the attention
    factor 0.1 ln(factor) + 1 unless the config gives one."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero in the ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)
