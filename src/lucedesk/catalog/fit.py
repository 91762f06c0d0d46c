"""How much memory a model takes in the engine, and whether a device has it: reckoned from
the file's header (a ModelSummary) before anything is loaded, so a model that cannot fit is
refused with both numbers instead of meeting the OOM killer halfway through its load, and a
pull picks the largest quant that fits.

    need = weights as the engine holds them   (catalog/held_formats.py: the file's blocks,
                                                8-bit levels or the dtype)
         + KV cache                            (the profile's pool; a derived pool: one
                                                full context at least)
         + the profile's activation reserve     (activations, logits, allocator slack)

No torch here: a device is named by its type ("cpu", "cuda") and a dtype by its name
("bfloat16"); the engine measures what is free (engine/memory.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lucedesk.catalog import held_formats
from lucedesk.catalog.held_formats import DTYPE_BYTES, HeldFormat
from lucedesk.catalog.summary import ModelSummary
from lucedesk.config import EngineConfig
from lucedesk.errors import ConfigError
from lucedesk.isa import cpu_flags, cpu_paths_from_flags

MIB = 1 << 20
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


def expected_kernels(config: EngineConfig, device: str) -> str:
    """The kernels `config` runs on a device of this type: kernels.resolve_kernels' rule,
    where a CPU's C++ kernels are taken to build (the machine's compiler is not asked)."""
    if config.kernels != "auto":
        return config.kernels
    return "triton" if device == "cuda" else "cpu"


def expected_weights(
    summary: ModelSummary,
    config: EngineConfig,
    device: str,
    dtype: str,
    cpu_paths: frozenset[str] | None = None,
) -> HeldFormat | None:
    """The form the weights will take: the held-format rule (catalog/held_formats.py), the
    one engine/build.py loads by, on this model's MLP type and this CPU's kernel paths
    (`cpu_paths`, default: what its flags say the C++ kernels get). None: the dtype."""
    if cpu_paths is None:
        cpu_paths = cpu_paths_from_flags(cpu_flags())
    kernels = expected_kernels(config, device)
    held = held_formats.choose(config.weights, kernels, dtype, summary.mlp_type, cpu_paths)
    head = (summary.vocab_size, summary.hidden_size)  # the shape most likely odd
    if held is not None and config.weights == "auto" and not held.fits(head):
        return None  # as the loader does (held_weights.choose_format)
    return held


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


def weight_bytes(summary: ModelSummary, held: HeldFormat | None, dtype: str) -> int:
    """The weights as the engine holds them (held_formats.held_bytes)."""
    return held_formats.held_bytes(
        held, dtype, summary.params, summary.matmuls(), summary.embedding(),
        summary.tied_embeddings,
    )  # fmt: skip


def estimate(
    summary: ModelSummary,
    config: EngineConfig,
    device: str,
    dtype: str,
    free_bytes: int | None = None,
    cpu_paths: frozenset[str] | None = None,
) -> MemoryNeed:
    """What loading the model under `config` takes. The KV term is the profile's pool; a
    pool derived from free memory counts as `free_bytes` would derive it (None: the least a
    model is usable with: its context, at most LEAST_CONTEXT tokens)."""
    held = expected_weights(summary, config, device, dtype, cpu_paths)
    weights = weight_bytes(summary, held, dtype)
    max_len = context_limit(config, summary.context)
    if config.kv_pool_tokens or free_bytes is None:
        tokens = config.kv_pool_tokens or min(max_len, LEAST_CONTEXT)
    else:
        tokens = max(derive_pool_tokens(config, summary, dtype, free_bytes - weights, max_len), 0)
    kv = tokens * kv_bytes_per_token(summary, dtype, config.kv_dtype)
    form = held.name if held is not None else "dtype"
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
        ways.append("a GGUF file of it (a GPU holds a GGUF file's blocks, other models in bf16)")
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
    # What `free_bytes` is where it is not what is free here now (a profile's device this
    # machine lacks: its own memory), for a reader; "" otherwise.
    where: str = ""
    # The C++ kernels' fast paths the rule goes by (None: this CPU's, by its flags).
    cpu_paths: frozenset[str] | None = None

    def need(self, summary: ModelSummary) -> MemoryNeed:
        """The least the model takes: weights, one full context or the fixed pool, reserve."""
        return estimate(summary, self.config, self.device, self.dtype, None, self.cpu_paths)

    def __call__(self, summary: ModelSummary) -> bool:
        try:
            return self.need(summary).total <= self.free_bytes
        except ConfigError:  # a named weight format that cannot hold this model
            return False

    def why_not(self, summary: ModelSummary) -> str | None:
        """Why the model cannot run here (its kind, its block types, its size), or None."""
        problem = self.unreadable(summary)
        if problem is not None:
            return problem
        try:
            need = self.need(summary)
        except ConfigError as exc:
            return str(exc)
        if need.total > self.free_bytes:
            return f"needs {gib(need.total)}, {gib(self.free_bytes)} free"
        return None

    def describe(self, summary: ModelSummary) -> str:
        """What the model takes here, part by part: weights (and their form), KV, reserve."""
        need = self.need(summary)
        return (
            f"{gib(need.total)}: {gib(need.weights)} of weights as {need.weight_format}, "
            f"{gib(need.kv)} of KV cache for {need.kv_tokens} tokens, {gib(need.reserve)} "
            "reserved"
        )
