"""What every Triton kernel shares about numbers: the dtype its dots take, and the one special
case of these kernels, Triton's interpreter in bf16 (`interpreting_bf16`), with the rounding
a GPU does there done by hand (`round_to_bf16`, `narrow`)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _dot_dtype(dtype: torch.dtype, interpret: bool | None = None):
    """The tile dtype of the kernel's matmuls: the cache's own, except bf16 under Triton's
    interpreter (see `interpreting_bf16`)."""
    if interpreting_bf16(dtype, interpret):
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[
        dtype
    ]


def interpreting_bf16(dtype: torch.dtype, interpret: bool | None = None) -> bool:
    """The one special case of these kernels. Triton's interpreter computes bf16 dots as
    garbage (numpy has no bf16) and narrows fp32 to bf16 by truncation. So there, bf16 tiles
    are widened to fp32 (exact) and the probabilities a GPU rounds to bf16 before the P.V
    dot are rounded by `round_to_bf16` instead: the same arithmetic a GPU does (bf16 inputs,
    fp32 accumulation), up to the order of the sums. `interpret`: whether kernels run in
    the interpreter (None: TRITON_INTERPRET says; False: as on a GPU, compile_targets')."""
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return dtype == torch.bfloat16 and interpret


@triton.jit
def narrow(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """float32 x to `dtype` as a GPU narrows it, to the nearest value; in the interpreter's
    bf16 (EMULATE_BF16) rounded first as `round_to_bf16` rounds (written out here: each
    nested call costs the interpreter milliseconds), which its truncating cast keeps."""
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32; finite inputs."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
