"""What the engine launches on a GPU, kernel by kernel: the specializations
compile_targets.py compiles for each target. Each one's constexprs come from the function
its wrapper's launch calls (attention_constants, norm_constants, launch_constants...), so
what is compiled is what runs.

The shapes: head sizes 64 (gpt-oss), 128 (Qwen3, Gemma 3 27B) and 256 (Gemma 3 270M);
attention tiles of 16 to MAX_TILE query rows x heads (a decode's rows, a drafted decode's),
the 8-bit cache or not; norms over the families' hidden sizes (576 to 5,376) and heads;
every held block type's matmul for decode (16 rows, split K), prompts (64 rows) and a
mixture's pairs, plain and gated, with and without biases. In the first dtype every shape,
in the others (fp16, fp32) the largest of each kind: register pressure grows with the tile,
and a dtype's own failures (a precision a target lacks) show in any shape of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


@dataclass(slots=True)
class Specialization:
    kernel: object  # the @triton.jit function
    label: str  # what the engine launches it for
    pointers: dict[str, str]  # pointer arguments -> their type ("*bf16"); others i32 / fp32
    constexprs: dict[str, object]
    floats: tuple[str, ...] = ()  # float32 scalar arguments
    wide: tuple[str, ...] = ()  # int64 scalar arguments
    num_warps: int = 4

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def signature(self) -> dict[str, str]:
        sig = {}
        for arg in self.kernel.arg_names:
            if arg in self.constexprs:
                sig[arg] = "constexpr"
            elif arg in self.pointers:
                sig[arg] = self.pointers[arg]
            else:
                sig[arg] = "fp32" if arg in self.floats else "i64" if arg in self.wide else "i32"
        return sig


HEAD_DIMS = (64, 128, 256)
HIDDEN = (576, 2048, 2880, 5376)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def attention(dtypes: tuple[torch.dtype, ...], quick: bool) -> Iterator[Specialization]:
    from lucedesk.kernels.attention_triton import (
        _attention_reduce_kernel,
        _attention_split_kernel,
        attention_constants,
        max_tile,
        reduce_constants,
    )

    ints = ("block_tables_ptr", "row_seq_ptr", "row_pos_ptr", "item_row_ptr", "item_len_ptr")
    floats = ("k_scale_ptr", "v_scale_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr")
    for dtype in dtypes:
        for head_dim in HEAD_DIMS:
            largest = max_tile(dtype, head_dim)
            tiles = (16, 32, 64) if dtype == dtypes[0] and not quick else (64,)
            for tile in sorted({min(t, largest) for t in tiles}):
                for quantized in (False, True):
                    # A group of 16 heads: rows 1, 2 and 4 make the tiles 16, 32 and 64.
                    constants = attention_constants(
                        dtype, 16, tile // 16, head_dim, 16, quantized, interpret=False
                    )
                    warps = constants.pop("num_warps")
                    cache = "*i8" if quantized else POINTER[dtype]
                    pointers = {n: "*i32" for n in ints} | {n: "*fp32" for n in floats}
                    pointers |= {"q_ptr": POINTER[dtype], "k_cache_ptr": cache}
                    pointers["v_cache_ptr"] = cache
                    label = f"{_name(dtype)} hd{head_dim} tile{tile}"
                    label += " kv-int8" if quantized else ""
                    yield Specialization(
                        _attention_split_kernel, label, pointers, constants, ("scale",),
                        num_warps=warps,
                    )  # fmt: skip
            for sinks in (False, True):
                pointers = {n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")}
                pointers |= {"sinks_ptr": "*fp32", "out_ptr": POINTER[dtype]}
                label = f"{_name(dtype)} hd{head_dim}" + (" sinks" if sinks else "")
                constants = reduce_constants(head_dim, sinks, dtype, interpret=False)
                yield Specialization(_attention_reduce_kernel, label, pointers, constants)


def kv_write(dtypes: tuple[torch.dtype, ...]) -> Iterator[Specialization]:
    from lucedesk.kernels.kv_write_triton import _write_kv_kernel

    for dtype in dtypes:
        for head_dim in HEAD_DIMS:
            for quantized in (False, True):
                cache = "*i8" if quantized else POINTER[dtype]
                pointers = {"k_ptr": POINTER[dtype], "v_ptr": POINTER[dtype], "slot_ptr": "*i64"}
                pointers |= {"k_cache_ptr": cache, "v_cache_ptr": cache}
                pointers |= {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
                label = f"{_name(dtype)} hd{head_dim}" + (" kv-int8" if quantized else "")
                constants = dict(HEAD_DIM=head_dim, QUANTIZED=quantized)
                yield Specialization(_write_kv_kernel, label, pointers, constants)


def layers(dtypes: tuple[torch.dtype, ...]) -> Iterator[Specialization]:
    from lucedesk.kernels.layers_triton import (
        _add_rms_norm_kernel,
        _rotary_kernel,
        norm_constants,
        rotary_constants,
    )

    for dtype in dtypes:
        for hidden in (*HEAD_DIMS, *HIDDEN):
            for weight_fp32 in (False, True):
                p = POINTER[dtype]
                pointers = {"x_ptr": p, "res_ptr": p, "out_ptr": p, "res_out_ptr": p}
                pointers["weight_ptr"] = "*fp32" if weight_fp32 else p
                label = f"{_name(dtype)} hidden {hidden}" + (" fp32 weight" if weight_fp32 else "")
                constants = norm_constants(True, weight_fp32, hidden, dtype, interpret=False)
                warps = constants.pop("num_warps")
                yield Specialization(
                    _add_rms_norm_kernel, label, pointers, constants, ("eps",), num_warps=warps
                )
        for head_dim in HEAD_DIMS:
            for q_heads, kv_heads in ((9, 3), (32, 4), (64, 8)):  # SmolLM2, Qwen3-MoE, gpt-oss
                pointers = {n: POINTER[dtype] for n in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr")}
                label = f"{_name(dtype)} hd{head_dim} {q_heads}/{kv_heads} heads"
                constants = rotary_constants(q_heads, kv_heads, head_dim, dtype, interpret=False)
                warps = constants.pop("num_warps")
                yield Specialization(_rotary_kernel, label, pointers, constants, num_warps=warps)


def experts(dtypes: tuple[torch.dtype, ...]) -> Iterator[Specialization]:
    """A mixture's experts in the model dtype (a safetensors folder's)."""
    from lucedesk.kernels.moe_triton import _grouped_linear_kernel, grouped_constants

    for dtype in dtypes:
        pointers = {"x_ptr": POINTER[dtype], "w_ptr": POINTER[dtype], "out_ptr": POINTER[dtype]}
        pointers |= {n: "*i64" for n in ("tile_expert_ptr", "tile_row_ptr", "tile_stop_ptr")}
        pointers["num_tiles_ptr"] = "*i64"
        constants = grouped_constants(dtype, interpret=False)
        yield Specialization(_grouped_linear_kernel, _name(dtype), pointers, constants)


def blocks(dtypes: tuple[torch.dtype, ...], quick: bool) -> Iterator[Specialization]:
    """Every held block type: decode (split K), prompt and a mixture's pairs, plain, gated
    (SiLU; gpt-oss's clamped SwiGLU with its biases for MXFP4 experts), and the embedding
    rows and the split sums."""
    from lucedesk.kernels.block_weights import launch_constants
    from lucedesk.kernels.blocks import KINDS
    from lucedesk.kernels.blocks_triton import (
        ACTIVATIONS,
        _block_matmul_kernel,
        _block_rows_kernel,
        _sum_splits_kernel,
        tiles_for,
    )

    for dtype in dtypes:
        decode = tiles_for(1, 1024, 4096, False, dtype, False)
        prompt = tiles_for(512, 4096, 4096, False, dtype, False)
        pairs = tiles_for(64, 4096, 4096, True, dtype, False)
        first = dtype == dtypes[0] and not quick
        for kind in KINDS if dtype == dtypes[0] else ("Q4_K", "Q6_K", "IQ4_XS"):
            planes = {"codes_ptr": "*i8" if kind == "Q8_0" else "*u8", "high_ptr": "*u8"}
            planes["scale_ptr"] = {"Q6_K": "*i8", "IQ4_XS": "*i8"}.get(kind, "*fp16")
            if kind in ("Q4_K", "Q5_K", "MXFP4"):
                planes["scale_ptr"] = "*u8"
            planes["offset_ptr"] = "*u8" if kind in ("Q4_K", "Q5_K") else "*fp16"
            planes |= {"sscale_ptr": "*fp16", "soffset_ptr": "*fp16", "lut_ptr": "*fp32"}
            launches = [("decode", decode, False, 0, False), ("prompt", prompt, False, 0, False)]
            launches += [("prompt gated", prompt, False, ACTIVATIONS["silu"], False)]
            if first:
                launches += [("decode gated", decode._replace(splits=1), False, 1, False)]
                launches += [("pairs gated", pairs, True, ACTIVATIONS["silu"], False)]
                launches += [("pairs", pairs, True, 0, False)]
            if kind == "MXFP4":
                launches += [("pairs swiglu bias", pairs, True, 3, True)]
            for what, tiles, grouped, act, bias in launches:
                pointers = {"x_ptr": POINTER[dtype], "out_ptr": POINTER[dtype]}
                pointers |= {"part_ptr": "*fp32", "bias_ptr": POINTER[dtype]} | planes
                pointers |= {n: "*i64" for n in ("tile_expert_ptr", "tile_row_ptr")}
                pointers |= {"tile_stop_ptr": "*i64", "num_tiles_ptr": "*i64"}
                constants = launch_constants(kind, dtype, tiles, grouped, act, bias, False)
                label = f"{_name(dtype)} {kind} {what}"
                yield Specialization(
                    _block_matmul_kernel, label, pointers, constants, ("limit", "alpha"),
                    num_warps=tiles.warps,
                )  # fmt: skip
            rows = {"ids_ptr": "*i64", "out_ptr": POINTER[dtype]} | planes
            constants = launch_constants(kind, dtype, decode, False, 0, False, False)
            constants = {k: constants[k] for k in ("KIND", "ROUND")} | {"BK": 256}
            yield Specialization(_block_rows_kernel, f"{_name(dtype)} {kind}", rows, constants)
        pointers = {"part_ptr": "*fp32", "out_ptr": POINTER[dtype]}
        constants = dict(SPLITS=decode.splits, BN=128, ROUND=0)
        yield Specialization(_sum_splits_kernel, _name(dtype), pointers, constants)


def all_launches(quick: bool = False) -> Iterator[Specialization]:
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    yield from attention(dtypes, quick)
    yield from kv_write(dtypes)
    yield from layers(dtypes)
    yield from experts(dtypes)
    yield from blocks(dtypes, quick)
