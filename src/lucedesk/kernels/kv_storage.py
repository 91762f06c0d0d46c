"""A layer's paged K/V storage, in the model dtype or in 8 bits.

    k, v:              [num_kv_heads, num_blocks, block_size, head_dim]  model dtype or int8
    k_scale, v_scale:  [num_kv_heads, num_blocks, block_size]            float32 (int8 only)

At 8 bits each token's row of each KV head is stored as `round(x / s)` in -127..127 with
`s = max|x| / 127` over the head's `head_dim` values (one float32 scale per token and KV
head). A row is quantized once, when its token's K/V is written, from that token's values
alone, and is never rewritten: what a request's cache holds depends only on its own tokens,
so batching, prefix sharing and drafts read the same bytes they would alone. The error of
an element is at most half a level, `max|x| / 254`.

The kernels take the scales as `k_scale` / `v_scale` keyword arguments (None: the cache is
in the model dtype)."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from lucedesk.kernels.checks import require

KV_DTYPES = ("dtype", "int8")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] -> (int8 [..., head_dim], float32 scales [...]): each row's absmax
    maps to 127, values rounded to the nearest level, halves up (`floor(y + 0.5)`, the rule
    every implementation uses). An all-zero row has scale 0."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0  # [...]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    levels = torch.floor(xf / safe[..., None] + 0.5).clamp_(-127, 127)
    return levels.to(torch.int8), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., head_dim] and float32 [...] -> dtype [..., head_dim]."""
    return (values.float() * scales[..., None]).to(dtype)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed cache tensor. In host memory it is an anonymous mapping of its own, whose pages
    the kernel maps zeroed on first touch: the pool is reserved, not written, so a start does
    not spend ~0.5 s a GB zeroing it (torch.zeros writes every byte), and the process's
    resident memory grows by the blocks used. Without transparent huge pages: a cache's
    layout puts each KV head's blocks apart, so a 2 MiB page per head, layer, K and V came
    with the first token written (numpy asks for huge pages on large arrays), 250 MB of the
    default model's pool resident for a 5-token prompt."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # private (a shared mapping's pages are shared memory, which a fork would share too),
    # page-aligned, unmapped when the last tensor on it goes
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


@dataclass(slots=True)
class LayerKV:
    """One layer's K and V caches (and their scales when 8-bit), as the runner allocates
    them and the attention kernels read them."""

    k: torch.Tensor  # [kvh, num_blocks, block_size, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [kvh, num_blocks, block_size] float32, int8 only
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        kv_dtype: str,
        device: torch.device | str,
    ) -> LayerKV:
        """Zeroed caches of `shape` = (kv_heads, num_blocks, block_size, head_dim): in
        `dtype` (the model's) for kv_dtype "dtype", int8 values with float32 scales for
        "int8"."""
        require(kv_dtype in KV_DTYPES, f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if kv_dtype == "dtype":
            return cls(zeros(shape, dtype, device), zeros(shape, dtype, device))
        return cls(
            zeros(shape, torch.int8, device),
            zeros(shape, torch.int8, device),
            zeros(shape[:3], torch.float32, device),
            zeros(shape[:3], torch.float32, device),
        )

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> list[torch.Tensor]:
        """K, V (and their scales, 8-bit only): each with the block axis second."""
        scales = [self.k_scale, self.v_scale] if self.k_scale is not None else []
        return [self.k, self.v, *scales]


def check_scales(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """An int8 cache comes with float32 scales of its first three dimensions, contiguous;
    a cache in a float dtype with none."""
    quantized = k_cache.dtype == torch.int8
    require(
        quantized
        == (k_scale is not None)
        == (v_scale is not None)
        == (v_cache.dtype == torch.int8),
        "an int8 K/V cache needs k_scale and v_scale (and a float cache none)",
    )
    if not quantized:
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert s is not None
        require(
            s.dtype == torch.float32 and s.shape == k_cache.shape[:3] and s.is_contiguous(),
            f"{name} must be contiguous float32 {tuple(k_cache.shape[:3])}, "
            f"got {s.dtype} {tuple(s.shape)}",
        )
