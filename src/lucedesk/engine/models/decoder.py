"""One decoder for every family lucedesk runs (Llama 2/3, SmolLM, Qwen2 with q/k/v bias,
Qwen3 with q/k norm, Qwen3-MoE, gpt-oss, Gemma 3); a family is a ModelConfig (config.py) and
how its files name the weights (families.py).

The forward takes a flat token axis: `input_ids[num_tokens]` and `positions[num_tokens]`
holding decode rows and prompt chunks of many sequences side by side, plus one attention
object that knows how those rows group into sequences and where their KV lives. The model
never sees slots, queues or block tables.

A layer, with the variants the families add in brackets:

    x ─ norm ─ qkv (+bias) ─ [q/k norm] ─ rotary ─ attention [window] [sinks] ─ o (+bias)
      ─ [norm] ─ + ─ norm ─ MLP: dense gated, or mixture of experts ─ [norm] ─ + ─►
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lucedesk.engine.models.config import FULL, SLIDING, ModelConfig, rope_inv_freq
from lucedesk.engine.models.moe import DenseMLP, MoEBlock
from lucedesk.kernels import Kernels, get_kernels
from lucedesk.kernels.kv_storage import LayerKV
from lucedesk.kernels.metadata import AttentionMetadata


class Attention(Protocol):
    """What the model asks of attention: the runner's paged implementation in the engine, or a
    plain causal one for a single sequence in tests."""

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]
        -> [num_tokens, num_heads, head_dim]; a row sees the last `window` keys (0: all),
        `sinks` (float32 [num_heads]) join each softmax."""
        ...

    def cache_rows(
        self, layer_idx: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, slot_mapping) where a fused call may write this step's K/V
        rows of `dtype` itself before `attend`; None: hand k and v to `__call__`."""
        ...

    def attend(
        self, layer_idx: int, q: torch.Tensor, window: int = 0, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`__call__` once the step's K/V rows are in the rows `cache_rows` named (called
        only where it named some)."""
        ...

    def stack_inputs(self) -> tuple[list[LayerKV], AttentionMetadata, float] | None:
        """(every layer's caches, the step's metadata, the softmax scale) for a model that
        runs its layers as one kernel call (`Kernels.stack`); None: per layer only."""
        ...


# A weight in another format (int8, 4-bit): called on activations [M, K] -> [M, N].
Projection = Callable[[torch.Tensor], torch.Tensor]
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ATTENTION = PROJECTIONS[:2]
# (layer or None for the LM head, projection) -> the file's blocks (GGUFFile.blocks).
BlockSource = Callable[[int | None, str], Any]


class RotaryTable:
    """cos/sin rows for positions, from one set of inverse frequencies; grown on demand."""

    def __init__(self, inv_freq: torch.Tensor, factor: float, dtype: torch.dtype, size: int):
        self.inv_freq, self.factor, self.dtype, self.size = inv_freq, factor, dtype, size
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens] -> cos, sin: [num_tokens, head_dim] in the model dtype."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if self._cache is None or self._cache[0].shape[0] < needed:
            size = max(needed, self.size, 1)
            t = torch.arange(size, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(t.device))
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.factor, emb.sin() * self.factor
            self._cache = (cos.to(self.dtype), sin.to(self.dtype))
        cos, sin = self._cache
        if cos.device != positions.device:
            self._cache = cos, sin = cos.to(positions.device), sin.to(positions.device)
        return cos[positions], sin[positions]


class DecoderModel(nn.Module):
    """Weights are held fused (q|k|v and gate|up) so each layer runs two input matmuls."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        c = config
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype) for i in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size, dtype=norm_dtype(c, dtype)))
        # As the reference rounds it: to the model dtype, then multiplied.
        self.embedding_scale = float(torch.tensor(c.embedding_scale, dtype=dtype))
        self.lm_head = (
            self.embed_tokens
            if c.tie_word_embeddings
            else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype))
        )
        # One rotary table per layer type; sliding layers share the full layers' unless the
        # family gives them a base of their own (then without the scaling).
        full = RotaryTable(
            *rope_inv_freq(c, None, c.rope_scaling), dtype, c.max_position_embeddings
        )
        local = full
        if c.rope_local_theta:
            local = RotaryTable(
                *rope_inv_freq(c, c.rope_local_theta), dtype, c.max_position_embeddings
            )
        self.rotary = {FULL: full, SLIDING: local}
        self.kernels: Kernels = get_kernels("torch")
        # All layers as one call a step (the kernels' LayerStack), where they take it.
        self.stack: Any = None
        self.weight_format = "dtype"  # or "int8" / "q4" after quantize()
        # A GGUF file's blocks of one projection (see GGUFFile.blocks), for "q4" and "int8".
        self.block_source: BlockSource | None = None
        # Where a mixture of experts' weights come from when they are not loaded densely
        # (a GGUF file's expert tensors, see families.ExpertSource).
        self.expert_source: Any = None
        self.lm_head_quantized: Projection | None = None
        # The embedding table held in a format of its own (a GPU's blocks): its rows by id.
        self.embedding_held: Any = None
        self.requires_grad_(False)

    def use_kernels(self, kernels: Kernels) -> None:
        """Norms, rotary and the experts' matmuls run through these (attention is the
        runner's, per step)."""
        self.kernels = kernels
        self._fuse()

    def _fuse(self) -> None:
        """Each layer whose shape and weights the kernels' fused calls take runs them; where
        every layer is in bfloat16 with weights the kernels' stack takes (low-bit, the
        experts' too), the stack runs all layers as one call a step."""
        for layer in self.layers:
            layer.use_fused(self.kernels, self.dtype)
        self.stack = self._layer_stack()

    def _layer_stack(self) -> Any:
        c, stack_type, layers = self.config, self.kernels.stack, list(self.layers)
        if stack_type is None or self.dtype != torch.bfloat16:
            return None
        if c.hidden_act not in stack_type.ACTIVATIONS:
            return None
        if any(layer.mlp is not None for layer in layers) and c.hidden_act == "swiglu_clamped":
            return None  # the stack's dense MLP is a SiLU or GELU gate
        weights = [
            tuple(layer.quantized.get(n) for n in (PROJECTIONS if layer.moe is None else ATTENTION))
            for layer in layers
        ]
        experts = [w for layer in layers if layer.moe for w in layer.moe.kernel_args()[1:3]]
        held = [w for ws in weights for w in ws]
        if not stack_type.accepts(*held) or not stack_type.accepts_experts(*experts, like=held[0]):
            return None
        stack = stack_type(
            c.rms_norm_eps, c.num_heads, c.num_kv_heads, held[0].vector, c.hidden_act
        )
        for i, (layer, ws) in enumerate(zip(layers, weights)):
            stack.add_layer(
                layer.attn_norm, layer.ffn_norm, ws, layer.window, c.layer_type(i) != FULL,
                layer.qkv_bias, layer.o_bias,
                (layer.q_norm, layer.k_norm) if c.qk_norm else None, layer.sinks,
                (layer.attn_out_norm, layer.ffn_out_norm) if c.sandwich_norms else None,
                layer.moe.kernel_args() if layer.moe is not None else None,
            )  # fmt: skip
        return stack

    def projection_weights(self) -> list[torch.Tensor]:
        """Every dense matmul weight `quantize` would convert, the LM head last."""
        return [p for layer in self.layers for p in layer.projections().values()] + [self.lm_head]

    def moe_blocks(self) -> list[tuple[int, MoEBlock]]:
        return [(i, layer.moe) for i, layer in enumerate(self.layers) if layer.moe is not None]

    def quantize(
        self, name: str, make: Callable[[int | None, str, torch.Tensor], Projection]
    ) -> None:
        """Every dense projection and the LM head become `make(layer, proj, weight)` (layer
        None and proj "lm_head" for the LM head); the originals are released. The embedding
        table stays as it is, for lookups. Experts are converted apart (families.py)."""
        for i, layer in enumerate(self.layers):
            for proj, param in layer.projections().items():
                layer.quantized[proj] = make(i, proj, param)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.lm_head_quantized = make(None, "lm_head", self.lm_head)
        if self.lm_head is not self.embed_tokens:
            self.lm_head.data = torch.empty(0, dtype=self.dtype, device=self.lm_head.device)
        self.weight_format = name
        self._fuse()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden] (before the
        final norm; `compute_logits` applies it to the rows that need logits)."""
        c = self.config
        if self.embedding_held is not None:
            x = self.embedding_held.rows(input_ids, self.dtype)  # [T, H]
        else:
            x = F.embedding(input_ids, self.embed_tokens)  # [T, H]
        if self.embedding_scale != 1.0:
            x = x * self.embedding_scale
        tables = {FULL: self.rotary[FULL](positions)}
        tables[SLIDING] = (
            tables[FULL]
            if self.rotary[SLIDING] is self.rotary[FULL]
            else self.rotary[SLIDING](positions)
        )
        stack = attention.stack_inputs() if self.stack is not None else None
        if stack is not None and self.stack.takes(x, *stack[:2]):
            (cos, sin), (local_cos, local_sin) = tables[FULL], tables[SLIDING]
            return self.stack(x, (cos, sin, local_cos, local_sin), *stack)
        residual = None
        for i, layer in enumerate(self.layers):
            cos, sin = tables[c.layer_type(i)]
            x, residual = layer(x, residual, cos, sin, attention, self.kernels)
        return x + residual if residual is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, H] -> logits [rows, vocab] in float32."""
        h, _ = self.kernels.add_rms_norm(
            hidden.contiguous(), None, self.norm, self.config.rms_norm_eps
        )
        if self.lm_head_quantized is not None:
            return self.lm_head_quantized(h).float()
        return F.linear(h, self.lm_head).float()


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        self.index = index
        self.window = c.window(index)
        H = c.hidden_size
        norms = norm_dtype(c, dtype)
        self.attn_norm = nn.Parameter(torch.ones(H, dtype=norms))
        self.ffn_norm = nn.Parameter(torch.ones(H, dtype=norms))
        if c.sandwich_norms:
            self.attn_out_norm = nn.Parameter(torch.ones(H, dtype=norms))
            self.ffn_out_norm = nn.Parameter(torch.ones(H, dtype=norms))
        self.qkv_proj = nn.Parameter(torch.empty(c.q_size + 2 * c.kv_size, H, dtype=dtype))
        self.qkv_bias = (
            nn.Parameter(torch.zeros(c.q_size + 2 * c.kv_size, dtype=dtype))
            if c.attention_bias
            else None
        )
        self.o_proj = nn.Parameter(torch.empty(H, c.q_size, dtype=dtype))
        self.o_bias = nn.Parameter(torch.zeros(H, dtype=dtype)) if c.o_proj_bias else None
        if c.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(c.head_dim, dtype=norms))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim, dtype=norms))
        # Sinks stay float32: they join softmaxes computed in float32.
        self.sinks = nn.Parameter(torch.zeros(c.num_heads)) if c.attention_sinks else None
        self.moe = MoEBlock(c, dtype) if c.is_moe_layer(index) else None
        self.mlp = None if self.moe is not None else DenseMLP(c, dtype)
        self.quantized: dict[str, Projection] = {}
        # Each projection's [N, K], kept while its weight is in its file or held otherwise.
        self.shapes = {name: tuple(p.shape) for name, p in self.projections().items()}
        # The kernels' fused calls for each half around attention, where they take it.
        self.fused_input: Any = None
        self.fused_mlp: Any = None

    def use_fused(self, kernels: Kernels, dtype: torch.dtype) -> None:
        """Takes the kernels' fused calls for each half they take: bfloat16, norms in that
        dtype, weights in the form the calls multiply, and for the MLP a dense SiLU gate or
        low-bit experts."""
        c, fused = self.c, kernels.fused
        self.fused_input = self.fused_mlp = None
        if fused is None or dtype != torch.bfloat16:
            if self.moe is not None:
                self.moe.fused = None
            return
        if self.moe is not None:  # after the norm, whatever its dtype
            self.moe.fused = fused if fused.accepts_experts(*self.moe.kernel_args()[1:3]) else None
        if c.float32_norms:
            return
        if fused.accepts(self.quantized.get("qkv_proj")):
            self.fused_input = fused
        dense = self.mlp is not None and c.hidden_act == "silu"
        if dense and fused.accepts(*(self.quantized.get(n) for n in ("gate_up_proj", "down_proj"))):
            self.fused_mlp = fused

    def projections(self) -> dict[str, nn.Parameter]:
        """The dense matmul weights of this layer (the MLP's when it is not a mixture)."""
        found = {"qkv_proj": self.qkv_proj, "o_proj": self.o_proj}
        if self.mlp is not None:
            found |= {"gate_up_proj": self.mlp.gate_up_proj, "down_proj": self.mlp.down_proj}
        return found

    def project(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias) with the named projection, in whatever format it is held."""
        quantized = self.quantized.get(name)
        if quantized is None:
            return F.linear(x, self.projections()[name], bias)
        y = quantized(x)
        return y if bias is None else y + bias

    def forward(
        self,
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
        if self.fused_input is not None:
            o, residual = self._fused_attention(x, residual, cos, sin, attention)
        else:
            h, residual = kernels.add_rms_norm(x, residual, self.attn_norm, eps)
            qkv = self.project("qkv_proj", h, self.qkv_bias)  # [T, q + 2kv]
            T = qkv.shape[0]
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.view(T, c.num_heads, c.head_dim)
            k = k.view(T, c.num_kv_heads, c.head_dim)
            v = v.view(T, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = norm_heads(kernels, q, self.q_norm, eps)
                k = norm_heads(kernels, k, self.k_norm, eps)
            q, k = kernels.rotary(q, k, cos, sin)  # cos/sin: [T, hd]
            o = attention(self.index, q, k, v, self.window, self.sinks)  # [T, nh, hd]
        x = self.project("o_proj", o.reshape(o.shape[0], c.q_size), self.o_bias)
        if c.sandwich_norms:
            x, _ = kernels.add_rms_norm(x, None, self.attn_out_norm, eps)

        if self.fused_mlp is not None:
            x, residual = self.fused_mlp.gated_mlp(
                x, residual, self.ffn_norm, eps,
                self.quantized["gate_up_proj"], self.quantized["down_proj"],
            )  # fmt: skip
        else:
            h, residual = kernels.add_rms_norm(x, residual, self.ffn_norm, eps)
            x = (
                self.moe(h, kernels)
                if self.moe is not None
                else self.mlp(h, self.project, self.quantized.get("gate_up_proj"))
            )
        if c.sandwich_norms:
            x, _ = kernels.add_rms_norm(x, None, self.ffn_out_norm, eps)
        return x, residual

    def _fused_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm, qkv, q/k norms, rotary and the K/V write in one call, then attention: the
        arithmetic of the separate calls. -> (o [T, nh, hd], x + residual)."""
        c = self.c
        cache = attention.cache_rows(self.index, x.dtype)
        q, k, v, residual = self.fused_input.attention_input(
            x, residual, self.attn_norm, c.rms_norm_eps, self.quantized["qkv_proj"],
            c.num_heads, c.num_kv_heads, cos, sin, cache, self.qkv_bias,
            (self.q_norm, self.k_norm) if c.qk_norm else None,
        )  # fmt: skip
        if cache is not None:
            return attention.attend(self.index, q, self.window, self.sinks), residual
        return attention(self.index, q, k, v, self.window, self.sinks), residual


def norm_dtype(c: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if c.float32_norms else dtype


def norm_heads(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, heads, hd] -> each head's row normed over head_dim (q and k norms), by the
    kernels' norm (a copy where the rows are not dense: views into the fused qkv)."""
    rows = x.contiguous().view(-1, x.shape[-1])
    return kernels.add_rms_norm(rows, None, weight, eps)[0].view(x.shape)
