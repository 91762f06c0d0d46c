"""CPU kernels in C++ (`csrc/`, built by `cpu_build`): paged decode attention that reads KV
blocks in place, prompt chunks as flash attention, the quantizing write into an 8-bit
cache, fused residual-add + RMSNorm and in-place rotary embedding, each behind a wrapper
that checks its arguments, and a dense layer's halves as one call each (`FusedLayerCalls`).
The quantized weights' matmuls are in `quantized`."""

from __future__ import annotations

import functools

import torch

from lucedesk.kernels.attention_torch import prefill_chunks, write_kv_torch
from lucedesk.kernels.checks import check_norm_args, check_rotary_args, require
from lucedesk.kernels.cpu_build import load_cpu_ops
from lucedesk.kernels.kv_storage import LayerKV, check_scales
from lucedesk.kernels.metadata import AttentionMetadata
from lucedesk.kernels.quantized import GroupedLowBitWeight, LowBitWeight

# Where a step's new K/V rows go: (k_cache, v_cache, slot_mapping).
CacheRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    require(q.dim() == 3, f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    require(k_cache.dim() == 4, f"k_cache must be 4-D, got {tuple(k_cache.shape)}")
    require(k_cache.shape == v_cache.shape, "k_cache and v_cache differ in shape")
    check_scales(k_cache, v_cache, k_scale, v_scale)
    require(
        k_scale is not None or q.dtype == k_cache.dtype == v_cache.dtype,
        f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}",
    )
    require(q.device.type == k_cache.device.type == "cpu", "the CPU kernels take CPU tensors only")
    require(q.shape[2] == k_cache.shape[3], "q and the cache differ in head_dim")
    require(q.shape[1] % k_cache.shape[0] == 0, "query heads must be a multiple of KV heads")
    require(q.stride(2) == 1, "q's head_dim must be contiguous")
    require(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")


@functools.cache
def flash_prefill_available() -> bool:
    """Whether this CPU runs the C++ flash kernel for prompt chunks (asked once)."""
    return bool(load_cpu_ops().prefill_attention_available())


def flash_prefill_takes(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Prompt chunks of q_dtype over a cache holding cache_dtype (bfloat16 for an 8-bit
    cache: its rows are widened to it) go through the flash kernel."""
    flash = q_dtype == cache_dtype == torch.bfloat16 and head_dim % 16 == 0
    return flash and flash_prefill_available()


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `paged_attention_torch`: decode sequences in C++ over the blocks in
    place, each block read once for all of a sequence's query rows (an int8 cache's rows and
    scales as stored); prompt chunks against bf16 or int8 caches by the C++ flash kernel
    where the CPU has AVX512-BF16 (csrc/prefill.h), others through torch's SDPA."""
    _check_inputs(q, k_cache, v_cache, k_scale, v_scale)
    require(q.shape[0] == meta.num_tokens, f"q has {q.shape[0]} rows, the step {meta.num_tokens}")
    require(window >= 0, f"window must be >= 0, got {window}")
    if sinks is not None:
        require(
            sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],),
            f"sinks must be float32 [{q.shape[1]}], got {sinks.dtype} {tuple(sinks.shape)}",
        )
        sinks = sinks.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    nd, rows = meta.num_decodes, meta.num_decode_tokens
    if nd:
        load_cpu_ops().paged_decode_attention(
            out[:rows],
            q[:rows],
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start[: nd + 1],
            scale,
            window,
            sinks,
            k_scale,
            v_scale,
        )
    if nd == meta.num_seqs:
        return out
    cache_dtype = torch.bfloat16 if k_scale is not None else k_cache.dtype
    if flash_prefill_takes(q.dtype, cache_dtype, q.shape[2]):
        load_cpu_ops().paged_prefill_attention(
            out,
            q,
            k_cache,
            v_cache,
            meta.block_tables[nd:],
            meta.seq_lens[nd:],
            meta.query_start[nd:],
            scale,
            window,
            sinks,
            k_scale,
            v_scale,
        )
    else:
        kv = LayerKV(k_cache, v_cache, k_scale, v_scale)
        prefill_chunks(q, kv, meta, scale, out, window, sinks)
    return out


def write_kv_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`write_kv_torch`'s contract; into an 8-bit cache each row is quantized in C++, to the
    bits of `kv_storage.quantize_rows` (one call, not a dozen torch ops a layer)."""
    check_scales(k_cache, v_cache, k_scale, v_scale)
    if k_scale is None or v_scale is None or k.stride(2) != 1 or v.stride(2) != 1:
        write_kv_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    load_cpu_ops().write_kv_int8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual) * weight, x + residual)."""
    check_norm_args(x, residual, weight)
    return load_cpu_ops().add_rms_norm(x, residual, weight, eps)


def rotary_cpu(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, nh, hd] and k [T, kvh, hd] in place (views into a fused qkv are fine);
    cos/sin: [T, hd], each row's table entry."""
    check_rotary_args(q, k, cos, sin)
    load_cpu_ops().rotary_(q, k, cos, sin)
    return q, k


def greedy_cpu(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, vocab] float32 -> [R] int64: torch.argmax(dim=-1)'s choice (the first
    maximum, a NaN above any number), vectorized; ~10x ATen's on a 49k vocabulary."""
    require(logits.dim() == 2, f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    require(logits.dtype == torch.float32, f"logits must be float32, got {logits.dtype}")
    return load_cpu_ops().greedy_tokens(logits if logits.stride(1) == 1 else logits.contiguous())


class FusedLayerCalls:
    """A layer's two halves around attention as one C++ call each (csrc/fused.h), bit for
    bit the separate calls: norm + qkv (+ bias) (+ q/k norms) + rotary (+ the K/V write),
    and norm + gate|up + SiLU * up + down. For bfloat16 activations and low-bit weights."""

    @staticmethod
    def accepts(*weights: object) -> bool:
        return all(isinstance(w, LowBitWeight) for w in weights)

    @staticmethod
    def accepts_experts(*weights: object) -> bool:
        grouped = all(isinstance(w, GroupedLowBitWeight) for w in weights)
        return grouped and len({w.vector for w in weights}) == 1

    @staticmethod
    def attention_input(
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: torch.Tensor,
        eps: float,
        qkv: LowBitWeight,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: CacheRows | None = None,
        bias: torch.Tensor | None = None,
        qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] (+ residual) -> (q [T, nh, hd], k, v [T, kvh, hd], x + residual) with q
        and k normed (`qk_norms`) and rotated; with `cache`, k and v are in their rows too."""
        k_cache, v_cache, slots = cache if cache is not None else (None, None, None)
        q_norm, k_norm = qk_norms if qk_norms is not None else (None, None)
        return load_cpu_ops().attention_input(
            x, residual, norm, eps, qkv.q, qkv.d, qkv.m, qkv.bits, qkv.vector, qkv.lut,
            bias, q_norm, k_norm, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slots,
        )  # fmt: skip

    @staticmethod
    def gated_mlp(
        x: torch.Tensor,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        gate_up: LowBitWeight,
        down: LowBitWeight,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] + residual -> (down(silu(gate) * up), x + residual)."""
        require(gate_up.vector == down.vector, "gate|up and down must take the same path")
        return load_cpu_ops().gated_mlp(
            x, residual, norm, eps, gate_up.q, gate_up.d, gate_up.m, gate_up.bits, gate_up.lut,
            down.q, down.d, down.m, down.bits, down.lut, down.vector,
        )  # fmt: skip

    @staticmethod
    def moe_mlp(
        h: torch.Tensor,
        activation: str,
        router: torch.Tensor,
        gate_up: GroupedLowBitWeight,
        down: GroupedLowBitWeight,
        biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
        top_k: int,
        softmax_first: bool,
        swiglu_limit: float,
        swiglu_alpha: float,
    ) -> torch.Tensor:
        """h [T, H] (normed) -> a mixture of experts' output [T, H] (csrc/moe.h): the
        float32 router's top k, the chosen experts' gate|up, activation and down, each
        row's weighted sum in rank order. biases: router, gate|up, down."""
        require(gate_up.vector == down.vector, "gate|up and down must take the same path")
        return load_cpu_ops().moe_mlp(
            h, router, [gate_up.q, gate_up.d, gate_up.m], [down.q, down.d, down.m],
            [gate_up.bits, down.bits], [gate_up.lut, down.lut], list(biases), top_k,
            softmax_first, activation, swiglu_limit, swiglu_alpha, down.vector,
        )  # fmt: skip
