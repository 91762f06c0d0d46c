"""A model's decoder layers as one C++ call a step (csrc/stack.h): per layer the norm and
attention input, the K/V write, paged attention, the o projection and the gated MLP (SiLU
or tanh GELU) or the mixture of experts (csrc/moe.h: router, the chosen experts' low-bit
matmuls, the weighted sum), with Gemma 3's float32 norms and its norms after attention and
the MLP where a layer has them: the functions the per-layer calls run, in their order on
their values, so the hidden states are theirs bit for bit. It takes a step when all of
its attention runs in C++: caches on the CPU in the activations' dtype or 8-bit, and
prompt chunks only where the flash kernel takes them (bfloat16, head_dim a multiple of
16, AVX512-BF16)."""

from __future__ import annotations

import torch

from lucedesk.kernels.checks import require
from lucedesk.kernels.cpu import flash_prefill_takes
from lucedesk.kernels.cpu_build import load_cpu_ops
from lucedesk.kernels.kv_storage import LayerKV
from lucedesk.kernels.metadata import AttentionMetadata
from lucedesk.kernels.quantized import GroupedLowBitWeight, LowBitWeight


class LayerStack:
    """Built once per model (`add_layer` per layer, in order), called once per step."""

    # The MLP activations it runs (the model config's hidden_act); the clamped SwiGLU in
    # experts only.
    ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")

    def __init__(
        self, eps: float, num_heads: int, num_kv_heads: int, vector: bool, activation: str
    ) -> None:
        load_cpu_ops()  # registers the class
        require(activation in self.ACTIVATIONS, f"a layer stack's MLP cannot run {activation}")
        self.vector = vector
        self.num_layers = 0
        self._stack = torch.classes.lucedesk_cpu.LayerStack(
            eps, num_heads, num_kv_heads, vector, activation
        )

    @staticmethod
    def accepts(*weights: object) -> bool:
        """Whether these weights can form a stack: low-bit, all on one path (VNNI or plain)."""
        low_bit = all(isinstance(w, LowBitWeight) for w in weights)
        return low_bit and len({w.vector for w in weights}) == 1

    @staticmethod
    def accepts_experts(*weights: object, like: LowBitWeight) -> bool:
        """Whether experts' weights can join a stack of `like`'s path."""
        grouped = all(isinstance(w, GroupedLowBitWeight) for w in weights)
        return grouped and all(w.vector == like.vector for w in weights)

    def add_layer(
        self,
        attn_norm: torch.Tensor,
        ffn_norm: torch.Tensor,
        weights: tuple[LowBitWeight, ...],
        window: int,
        local: bool,
        qkv_bias: torch.Tensor | None = None,
        o_bias: torch.Tensor | None = None,
        qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
        sinks: torch.Tensor | None = None,
        out_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
        experts: tuple | None = None,
    ) -> None:
        """weights: qkv, o, gate|up, down, or qkv and o of a layer of `experts` (what
        models/moe.MoEBlock.kernel_args gives); `local` layers take the local rotary table;
        out_norms (Gemma 3's sandwich) apply to the o projection's and the MLP's outputs.
        Norm weights are bfloat16 or float32."""
        require(
            self.accepts(*weights) and weights[0].vector == self.vector,
            "a layer stack's weights are low-bit, all on the stack's path",
        )
        require(len(weights) == (2 if experts else 4), "a layer's MLP is dense or experts")
        require(sinks is None or sinks.dtype == torch.float32, "sinks must be float32")
        q_norm, k_norm = qk_norms if qk_norms is not None else (None, None)
        attn_out, ffn_out = out_norms if out_norms is not None else (None, None)
        extras = [qkv_bias, o_bias, q_norm, k_norm, sinks, attn_out, ffn_out]
        tensors = [[w.q, w.d, w.m] for w in weights] + [[], []][: 4 - len(weights)]
        self._stack.add_layer(
            attn_norm, ffn_norm, *tensors, [w.bits for w in weights], [w.lut for w in weights],
            extras, window, local,
        )  # fmt: skip
        if experts is not None:
            router, gate_up, down, biases, top_k, softmax_first, limit, alpha = experts
            require(
                self.accepts_experts(gate_up, down, like=weights[0]),
                "a layer stack's experts are low-bit, on the stack's path",
            )
            self._stack.add_experts(
                router, [gate_up.q, gate_up.d, gate_up.m], [down.q, down.d, down.m],
                [gate_up.bits, down.bits], [gate_up.lut, down.lut], list(biases), top_k,
                softmax_first, limit, alpha,
            )  # fmt: skip
        self.num_layers += 1

    @staticmethod
    def takes(x: torch.Tensor, caches: list[LayerKV], meta: AttentionMetadata) -> bool:
        """Whether the whole step's attention runs in C++ (see the module's note)."""
        kv = caches[0]
        if x.dtype != torch.bfloat16 or kv.k.device.type != "cpu":
            return False
        if kv.k_scale is None and kv.k.dtype != x.dtype:
            return False
        prompt_chunks = meta.num_decodes < meta.num_seqs
        return not prompt_chunks or flash_prefill_takes(x.dtype, torch.bfloat16, kv.k.shape[3])

    def __call__(
        self,
        x: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        caches: list[LayerKV],
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """x [T, H] embeddings -> the last layer's x + residual [T, H]. tables: cos, sin
        for global layers, then for local ones ([T, head_dim] each)."""
        require(len(caches) == self.num_layers, "a layer stack takes one cache per layer")
        return self._stack.forward(
            x, *tables, [kv.k for kv in caches], [kv.v for kv in caches],
            [kv.k_scale for kv in caches], [kv.v_scale for kv in caches], meta.slot_mapping,
            meta.block_tables, meta.seq_lens, meta.query_start, meta.num_decodes, scale,
        )  # fmt: skip
