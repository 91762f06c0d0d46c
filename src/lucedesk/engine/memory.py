"""How much memory a model takes in the engine, and whether the device has it: checked from
the file's header before anything is loaded, so a model that cannot fit is refused with
both numbers instead of meeting the OOM killer halfway through its load.

    need = weights as the engine holds them   (file blocks, 8-bit levels or the dtype)
         + KV cache                            (the profile's pool; a derived pool: one
                                                full context at least)
         + the profile's activation reserve     (activations, logits, allocator slack)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lucedesk.catalog.summary import ModelSummary
from lucedesk.config import EngineConfig
from lucedesk.engine.device import resolve_device, resolve_dtype
from lucedesk.errors import ConfigError

MIB = 1 << 20
INT8_BYTES = 1.125  # a weight at 8 bits with a 16-bit scale per 32
FOUR_BIT_HEAD = 0.5625  # a tied LM head from a 4-bit embedding: 4 bits + scale and minimum
# The least KV a derived pool must hold for a model to count as fitting: a profile without
# max_model_len runs a 131k-context model on whatever pool the memory left derives.
LEAST_CONTEXT = 8192


def kv_bytes_per_token(model, dtype: torch.dtype, kv_dtype: str = "dtype") -> int:
    """K and V, every layer, every KV head: `head_dim` values in the model dtype, or at
    kv_dtype "int8" one byte each plus the row's float32 scale. `model`: a ModelConfig or
    a ModelSummary (its num_layers, num_kv_heads, head_dim)."""
    row = model.head_dim + 4 if kv_dtype == "int8" else model.head_dim * dtype.itemsize
    return 2 * model.num_layers * model.num_kv_heads * row


def available_memory(device: torch.device, unified: bool = False) -> int:
    """Bytes free for the KV pool now (after the weights are in place). On a unified-memory
    APU the GPU allocates from system RAM, so the smaller of the two counts."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if unified:
            return min(int(free), available_memory(torch.device("cpu")))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def derive_pool_tokens(
    config: EngineConfig, model, dtype: torch.dtype, free_bytes: int, max_len: int
) -> int:
    """KV capacity in tokens: the configured number, or `kv_memory_fraction` of the free
    memory; never more than every slot at full context, and whole blocks only."""
    cap = config.max_slots * max_len
    if config.kv_pool_tokens:
        tokens = config.kv_pool_tokens
    else:
        tokens = min(
            int(free_bytes * config.kv_memory_fraction)
            // kv_bytes_per_token(model, dtype, config.kv_dtype),
            cap,
        )
    return tokens // config.block_size * config.block_size


def return_free_memory() -> None:
    """Hands the C heap's free pages back to the system. glibc keeps what a load freed (the
    float weights a file's blocks replaced, the dequantizing buffers) for reuse, and raises
    its threshold for mapping large blocks after freeing such ones: on Gemma 3 270M about
    1 GB of resident memory stayed behind a finished load until trimmed."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        return
    if trim is not None:
        trim(0)


def context_limit(config: EngineConfig, model_context: int) -> int:
    """The longest sequence: the profile's max_model_len, within the model's own."""
    return min(config.max_model_len or model_context, model_context)


def expected_weights(summary: ModelSummary, config: EngineConfig, device, dtype) -> str:
    """The form the weights will take (build.apply_weight_format decides it from the loaded
    model; this reads the same rule off the summary): the C++ kernels on a bf16 CPU model
    hold a 4-bit file's blocks (q4) and other files at 8 bits; anything else is the dtype."""
    if config.weights != "auto":
        return config.weights
    if device.type == "cpu" and config.kernels in ("auto", "cpu") and dtype == torch.bfloat16:
        return "q4" if summary.low_bit else "int8"
    return "dtype"


@dataclass(slots=True, frozen=True)
class MemoryNeed:
    weights: int
    kv: int
    reserve: int
    kv_tokens: int
    weight_format: str

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.reserve


def weight_bytes(summary: ModelSummary, form: str, dtype: torch.dtype) -> int:
    """The weights as the engine holds them: every one in the dtype, or (q4, int8) the
    matmuls and the LM head (a tied one is a second copy of the embedding) as the file's
    4-bit blocks or at 8 bits, and the embedding table in the dtype."""
    width = dtype.itemsize
    if form == "dtype":
        return summary.params * width
    embedding = summary.embedding_params
    tied_head = embedding if summary.tied_embeddings else 0
    if form == "q4" and summary.low_bit:
        held = summary.low_bit_bytes or (  # read off the file's tensor table, else its size
            summary.size_bytes
            - embedding * summary.size_bytes // max(summary.params, 1)
            + tied_head * FOUR_BIT_HEAD
        )
    else:
        held = (summary.params - embedding + tied_head) * INT8_BYTES
    return int(held + embedding * width)


def estimate(
    summary: ModelSummary,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    free_bytes: int | None = None,
) -> MemoryNeed:
    """What loading the model under `config` takes. The KV term is the profile's pool; a
    pool derived from free memory counts as `free_bytes` would derive it (None: the least a
    model is usable with: its context, at most LEAST_CONTEXT tokens)."""
    form = expected_weights(summary, config, device, dtype)
    weights = weight_bytes(summary, form, dtype)
    max_len = context_limit(config, summary.context)
    if config.kv_pool_tokens or free_bytes is None:
        tokens = config.kv_pool_tokens or min(max_len, LEAST_CONTEXT)
    else:
        tokens = max(derive_pool_tokens(config, summary, dtype, free_bytes - weights, max_len), 0)
    kv = tokens * kv_bytes_per_token(summary, dtype, config.kv_dtype)
    return MemoryNeed(weights, kv, config.activation_reserve_mb * MIB, tokens, form)


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def check_fits(
    summary: ModelSummary, config: EngineConfig, device, dtype, free_bytes: int, what: str
) -> MemoryNeed:
    """The least the model needs, refused with both numbers and ways out where the device
    does not have it."""
    need = estimate(summary, config, device, dtype)
    if need.total <= free_bytes:
        return need
    where = "GPU memory" if device.type == "cuda" else "memory"
    ways = ["a smaller quant of it"]
    if need.kv_tokens > 4096:
        shorter = "kv_pool_tokens" if config.kv_pool_tokens else "max_model_len"
        ways.append(f"a shorter context (--set {shorter}=4096)")
    if need.weight_format == "dtype" and device.type == "cuda":
        ways.append("a smaller model (GPU profiles hold every weight in the model dtype)")
    raise ConfigError(
        f"{what} needs {gib(need.total)} ({gib(need.weights)} of weights as "
        f"{need.weight_format}, {gib(need.kv)} of KV cache for {need.kv_tokens} tokens, "
        f"{gib(need.reserve)} reserved for activations) and this machine has "
        f"{gib(free_bytes)} of {where} free: try " + ", or ".join(ways)
    )


@dataclass(slots=True, frozen=True)
class Fit:
    """Whether models fit this device under one profile's settings."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    free_bytes: int  # free now, and what a running engine gives back on a switch

    @classmethod
    def now(cls, config: EngineConfig, given_back: int = 0) -> Fit:
        device = resolve_device(config.device)
        free = available_memory(device, config.unified_memory) + given_back
        return cls(config, device, resolve_dtype(config.dtype, device), free)

    def need(self, summary: ModelSummary) -> MemoryNeed:
        """The least the model takes: weights, one full context or the fixed pool, reserve."""
        return estimate(summary, self.config, self.device, self.dtype)

    def __call__(self, summary: ModelSummary) -> bool:
        return self.need(summary).total <= self.free_bytes

    def why_not(self, summary: ModelSummary) -> str | None:
        """Why the model cannot run here (its kind, its block types, its size), or None."""
        from lucedesk.catalog.quants import LOADABLE
        from lucedesk.engine.models.families import BY_GGUF_ARCH, BY_HF_TYPE
        from lucedesk.engine.models.gguf_blocks import SUPPORTED_TYPES

        if summary.architecture not in BY_GGUF_ARCH and summary.architecture not in BY_HF_TYPE:
            return f"architecture {summary.architecture!r} is not one lucedesk runs"
        if summary.quant.startswith("quantized"):
            return f"its weights are {summary.quant}, which lucedesk does not read"
        unread = [t for t in summary.tensor_types if t not in SUPPORTED_TYPES]
        if unread:
            return f"its tensors in {', '.join(unread)} are of a type lucedesk does not read"
        if not summary.tensor_types and summary.quant.isupper() and summary.quant not in LOADABLE:
            return f"quant {summary.quant} has block types lucedesk does not read"
        need = self.need(summary)
        if need.total > self.free_bytes:
            return f"needs {gib(need.total)}, {gib(self.free_bytes)} free"
        return None
