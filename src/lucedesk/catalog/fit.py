"""How much memory a model takes in the engine, and whether a device has it: reckoned from
the file's header (a ModelSummary) before anything is loaded, so a model that cannot fit is
refused with both numbers instead of meeting the OOM killer halfway through its load, and a
pull picks the largest quant that fits.

    need = weights as the engine holds them   (file blocks, 8-bit levels or the dtype)
         + KV cache                            (the profile's pool; a derived pool: one
                                                full context at least)
         + the profile's activation reserve     (activations, logits, allocator slack)

No torch here: a device is named by its type ("cpu", "cuda") and a dtype by its name
("bfloat16"); the engine measures what is free (engine/memory.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lucedesk.catalog.summary import ModelSummary
from lucedesk.config import EngineConfig
from lucedesk.errors import ConfigError

MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT8_BYTES = 1.125  # a weight at 8 bits with a 16-bit scale per 32
FOUR_BIT_HEAD = 0.5625  # a tied LM head from a 4-bit embedding: 4 bits + scale and minimum
# The least KV a derived pool must hold for a model to count as fitting: a profile without
# max_model_len runs a 131k-context model on whatever pool the memory left derives.
LEAST_CONTEXT = 8192


def kv_bytes_per_token(model, dtype: str, kv_dtype: str = "dtype") -> int:
    """K and V, every layer, every KV head: `head_dim` values in the model dtype, or at
    kv_dtype "int8" one byte each plus the row's float32 scale. `model`: a ModelConfig or
    a ModelSummary (its num_layers, num_kv_heads, head_dim)."""
    row = model.head_dim + 4 if kv_dtype == "int8" else model.head_dim * DTYPE_BYTES[dtype]
    return 2 * model.num_layers * model.num_kv_heads * row


def derive_pool_tokens(
    config: EngineConfig, model, dtype: str, free_bytes: int, max_len: int
) -> int:
    """KV capacity in tokens: `pool_basis`'s."""
    return pool_basis(config, model, dtype, free_bytes, max_len)[0]


def pool_basis(
    config: EngineConfig, model, dtype: str, free_bytes: int, max_len: int
) -> tuple[int, str]:
    """KV capacity in tokens, whole blocks, and why that many: the configured number, else
    what every slot can use at the context limit (`max_slots` x `max_len`), else, where
    that is more, `kv_memory_fraction` of the free memory."""
    cap = config.max_slots * max_len
    if config.kv_pool_tokens:
        tokens, why = config.kv_pool_tokens, "set by kv_pool_tokens"
    else:
        share = int(free_bytes * config.kv_memory_fraction) // kv_bytes_per_token(
            model, dtype, config.kv_dtype
        )
        if cap <= share:
            tokens, why = cap, f"{config.max_slots} slots x {max_len} tokens"
        else:
            unified = " (unified)" if config.unified_memory else ""
            why = f"{config.kv_memory_fraction:g} of {free_bytes / 2**30:.1f} GiB free{unified}"
            tokens = share
    return tokens // config.block_size * config.block_size, why


def context_limit(config: EngineConfig, model_context: int) -> int:
    """The longest sequence: the profile's max_model_len, within the model's own."""
    return min(config.max_model_len or model_context, model_context)


def expected_weights(summary: ModelSummary, config: EngineConfig, device: str, dtype: str) -> str:
    """The form the weights will take (build.apply_weight_format decides it from the loaded
    model; this reads the same rule off the summary): the C++ kernels on a bf16 CPU model
    hold a 4-bit file's blocks (q4) and other files at 8 bits; anything else is the dtype."""
    if config.weights != "auto":
        return config.weights
    if device == "cpu" and config.kernels in ("auto", "cpu") and dtype == "bfloat16":
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


def weight_bytes(summary: ModelSummary, form: str, dtype: str) -> int:
    """The weights as the engine holds them: every one in the dtype, or (q4, int8) the
    matmuls and the LM head (a tied one is a second copy of the embedding) as the file's
    4-bit blocks or at 8 bits, and the embedding table in the dtype."""
    width = DTYPE_BYTES[dtype]
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
    device: str,
    dtype: str,
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
    summary: ModelSummary, config: EngineConfig, device: str, dtype: str, free_bytes: int, what: str
) -> MemoryNeed:
    """The least the model needs, refused with both numbers and ways out where the device
    does not have it."""
    need = estimate(summary, config, device, dtype)
    if need.total <= free_bytes:
        return need
    where = "GPU memory" if device == "cuda" else "memory"
    ways = ["a smaller quant of it"]
    if need.kv_tokens > 4096:
        shorter = "kv_pool_tokens" if config.kv_pool_tokens else "max_model_len"
        ways.append(f"a shorter context (--set {shorter}=4096)")
    if need.weight_format == "dtype" and device == "cuda":
        ways.append("a smaller model (GPU profiles hold every weight in the model dtype)")
    raise ConfigError(
        f"{what} needs {gib(need.total)} ({gib(need.weights)} of weights as "
        f"{need.weight_format}, {gib(need.kv)} of KV cache for {need.kv_tokens} tokens, "
        f"{gib(need.reserve)} reserved for activations) and this machine has "
        f"{gib(free_bytes)} of {where} free: try " + ", or ".join(ways)
    )


@dataclass(slots=True, frozen=True)
class Fit:
    """Whether models fit one device under one profile's settings. `unreadable` says why
    the engine cannot read a model at all (its architecture, its tensor types), or None;
    the engine's own is engine.memory.unreadable, and `engine.fit_now` builds a Fit with it
    from what is free now."""

    config: EngineConfig
    device: str  # its type: cpu, cuda
    dtype: str
    free_bytes: int  # free now, and what a running engine gives back on a switch
    unreadable: Callable[[ModelSummary], str | None] = lambda summary: None

    def need(self, summary: ModelSummary) -> MemoryNeed:
        """The least the model takes: weights, one full context or the fixed pool, reserve."""
        return estimate(summary, self.config, self.device, self.dtype)

    def __call__(self, summary: ModelSummary) -> bool:
        return self.need(summary).total <= self.free_bytes

    def why_not(self, summary: ModelSummary) -> str | None:
        """Why the model cannot run here (its kind, its block types, its size), or None."""
        problem = self.unreadable(summary)
        if problem is not None:
            return problem
        need = self.need(summary)
        if need.total > self.free_bytes:
            return f"needs {gib(need.total)}, {gib(self.free_bytes)} free"
        return None
