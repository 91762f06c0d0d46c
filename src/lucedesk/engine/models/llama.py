"""One Llama-family decoder (Llama 2/3, SmolLM, Qwen2 with q/k/v bias, Qwen3 with q/k norm).

The forward takes a flat token axis: `input_ids[num_tokens]` and `positions[num_tokens]`
holding decode rows and prompt chunks of many sequences side by side, plus one attention
object that knows how those rows group into sequences and where their KV lives. The model
never sees slots, queues or block tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lucedesk.kernels import Kernels, get_kernels
from lucedesk.kernels.layers_torch import rms_norm


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling dict ({"rope_type": "llama3" | "linear", ...}) or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q, k and v
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k
    name: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class Attention(Protocol):
    """What the model asks of attention: the runner's paged implementation in the engine, or a
    plain causal one for a single sequence in tests."""

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]
        -> [num_tokens, num_heads, head_dim]."""
        ...


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
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
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq.float()


# A weight in another format (int8): called on activations [M, K] -> [M, N].
Projection = Callable[[torch.Tensor], torch.Tensor]
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# (layer or None for the LM head, projection) -> the file's blocks (GGUFFile.four_bit).
FourBitSource = Callable[[int | None, str], Any]


class LlamaModel(nn.Module):
    """Weights are held fused (q|k|v and gate|up) so each layer runs two input matmuls."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        c = config
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(c, dtype) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size, dtype=dtype))
        self.lm_head = (
            self.embed_tokens
            if c.tie_word_embeddings
            else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype))
        )
        inv_freq = rope_inv_freq(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kernels: Kernels = get_kernels("torch")
        self.weight_format = "dtype"  # or "int8" / "q4" after quantize()
        # A GGUF file's 4-bit blocks of one projection (see GGUFFile.four_bit), for "q4".
        self.four_bit_source: FourBitSource | None = None
        self.lm_head_quantized: Projection | None = None
        self.requires_grad_(False)

    def use_kernels(self, kernels: Kernels) -> None:
        """Norms and rotary run through these (attention is the runner's, per step)."""
        self.kernels = kernels

    def projection_weights(self) -> list[torch.Tensor]:
        """Every matmul weight `quantize` would convert, the LM head last."""
        return [getattr(layer, p) for layer in self.layers for p in PROJECTIONS] + [self.lm_head]

    def quantize(
        self, name: str, make: Callable[[int | None, str, torch.Tensor], Projection]
    ) -> None:
        """Every projection and the LM head become `make(layer, proj, weight)` (layer None
        and proj "lm_head" for the LM head); the originals are released. The embedding
        table stays as it is, for lookups."""
        for i, layer in enumerate(self.layers):
            for proj in PROJECTIONS:
                param = getattr(layer, proj)
                layer.quantized[proj] = make(i, proj, param)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.lm_head_quantized = make(None, "lm_head", self.lm_head)
        if self.lm_head is not self.embed_tokens:
            self.lm_head.data = torch.empty(0, dtype=self.dtype, device=self.lm_head.device)
        self.weight_format = name

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for each row: [num_tokens, head_dim] in the model dtype (one table)."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope_cache is None or self._rope_cache[0].shape[0] < needed:
            size = max(needed, self.config.max_position_embeddings, 1)
            t = torch.arange(size, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache = (emb.cos().to(self.dtype), emb.sin().to(self.dtype))
        cos, sin = self._rope_cache
        return cos[positions], sin[positions]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden] (before the
        final norm; `compute_logits` applies it to the rows that need logits)."""
        x = F.embedding(input_ids, self.embed_tokens)  # [T, H]
        cos, sin = self.rope_cos_sin(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(i, x, residual, cos, sin, attention, self.kernels)
        return x + residual if residual is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, H] -> logits [rows, vocab] in float32."""
        h = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        if self.lm_head_quantized is not None:
            return self.lm_head_quantized(h).float()
        return F.linear(h, self.lm_head).float()


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        H = c.hidden_size
        self.input_norm = nn.Parameter(torch.ones(H, dtype=dtype))
        self.post_attention_norm = nn.Parameter(torch.ones(H, dtype=dtype))
        self.qkv_proj = nn.Parameter(torch.empty(c.q_size + 2 * c.kv_size, H, dtype=dtype))
        self.qkv_bias = (
            nn.Parameter(torch.zeros(c.q_size + 2 * c.kv_size, dtype=dtype))
            if c.attention_bias
            else None
        )
        self.o_proj = nn.Parameter(torch.empty(H, c.q_size, dtype=dtype))
        if c.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(c.head_dim, dtype=dtype))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim, dtype=dtype))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * c.intermediate_size, H, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(H, c.intermediate_size, dtype=dtype))
        self.quantized: dict[str, Projection] = {}

    def project(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias) with the named projection, in whatever format it is held."""
        quantized = self.quantized.get(name)
        if quantized is None:
            return F.linear(x, getattr(self, name), bias)
        y = quantized(x)
        return y if bias is None else y + bias

    def forward(
        self,
        layer_idx: int,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
        kernels: Kernels,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        eps = c.rms_norm_eps
        # x: [T, H]; the residual stream is carried separately so each norm reads x + residual.
        h, residual = kernels.add_rms_norm(x, residual, self.input_norm, eps)

        qkv = self.project("qkv_proj", h, self.qkv_bias)  # [T, q + 2kv]
        T = qkv.shape[0]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(T, c.num_heads, c.head_dim)
        k = k.view(T, c.num_kv_heads, c.head_dim)
        v = v.view(T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
        q, k = kernels.rotary(q, k, cos, sin)  # cos/sin: [T, hd]
        o = attention(layer_idx, q, k, v)  # [T, nh, hd]
        x = self.project("o_proj", o.reshape(T, c.q_size))

        h, residual = kernels.add_rms_norm(x, residual, self.post_attention_norm, eps)
        gate_up = self.project("gate_up_proj", h)  # [T, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        x = self.project("down_proj", F.silu(gate) * up)
        return x, residual


def load_weights(model: LlamaModel, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy HF-named tensors (see loader.py) into the fused layout, converting dtype.

    Raises KeyError-free ModelLoadError naming the first missing tensor."""
    from lucedesk.errors import ModelLoadError

    c = model.config

    def take(name: str) -> torch.Tensor:
        try:
            return weights.pop(name)
        except KeyError:
            raise ModelLoadError(f"{source}: missing tensor {name!r}") from None

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(value.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        param.data.copy_(value.to(param.dtype))

    put(model.embed_tokens, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
    put(model.norm, take("model.norm.weight"), "model.norm.weight")
    if not c.tie_word_embeddings:
        put(model.lm_head, take("lm_head.weight"), "lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
        put(
            layer.post_attention_norm,
            take(p + "post_attention_layernorm.weight"),
            p + "post_attention_layernorm.weight",
        )
        qkv = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        put(layer.qkv_proj, torch.cat(qkv, 0), p + "self_attn.qkv_proj.weight")
        if c.attention_bias:
            bias = [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            put(layer.qkv_bias, torch.cat(bias, 0), p + "self_attn.qkv_proj.bias")
        put(layer.o_proj, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
        if c.qk_norm:
            put(layer.q_norm, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
            put(layer.k_norm, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
        gate_up = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
        put(layer.gate_up_proj, torch.cat(gate_up, 0), p + "mlp.gate_up_proj.weight")
        put(layer.down_proj, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")


class CausalAttention:
    """Attention for one whole sequence with no cache: the simple reference path, used to
    check model code against other implementations."""

    def __init__(self, head_dim: int) -> None:
        self.scale = head_dim**-0.5

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        from lucedesk.kernels.attention_torch import causal_attention_torch

        return causal_attention_torch(q, k, v, self.scale)
