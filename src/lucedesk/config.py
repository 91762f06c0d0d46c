"""Engine settings: one `EngineConfig`, filled from a hardware profile or by hand."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lucedesk.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNELS = ("auto", "torch", "cpu", "triton")
WEIGHTS = ("auto", "dtype", "int8", "q4")
KV_DTYPES = ("dtype", "int8")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    max_slots: int = 16  # concurrent sequences, each in a stable slot
    block_size: int = 16  # tokens per KV block
    kv_pool_tokens: int = 0  # KV capacity in tokens; 0 = derive from free memory
    kv_memory_fraction: float = 0.5  # of the memory left after the weights, when deriving
    # Memory kept for activations, logits and the allocator beyond weights and KV: what a
    # model's fit is checked with before it loads (catalog/fit.py).
    activation_reserve_mb: int = 512
    unified_memory: bool = False  # GPU memory is system RAM (APUs): derive from the smaller
    # The memory (GiB) the profile's device gives lucedesk when nothing else runs on it:
    # what a model's fit is judged by on a machine without that device (0: not judged).
    device_memory_gb: float = 0.0
    max_model_len: int = 0  # 0 = the model's own context length
    max_num_batched_tokens: int = 512  # token budget of one step (decode rows + chunks)
    prefill_chunk_idle: int = 512  # prompt tokens per step while nothing decodes
    prefill_chunk_decoding: int = 128  # ...and while some slot decodes (keeps ITL low)
    # Paced chunks (engine/pacing.py): while a watched stream decodes, or one that was
    # streaming before a prompt in line came, the prompt chunk is sized from timed steps so
    # that a step takes at most this many times what its decode rows take alone, or
    # decode_step_ms where that is more (between one block and prefill_chunk_idle); else,
    # and with 0, the fixed prefill_chunk_decoding.
    decode_slowdown: float = 0.0
    decode_step_ms: int = 0
    decode_headroom_tokens: int = 16  # reserved at admission beyond the prompt
    max_waiting: int = 256  # queued requests before the server answers 503
    dtype: str = "auto"  # auto = bfloat16 where the device computes it fast, else float32
    kernels: str = "auto"  # auto = triton on a GPU, the C++ cpu kernels (or torch) on a CPU
    # dtype = matmul weights in the model dtype; int8 = weight-only int8 (cpu kernels, bf16;
    # on the VNNI kernels where they run, else on AMX tiles where the CPU has them);
    # q4 = a GGUF file's blocks as they are: 4-bit ones at 4 bits, Q5_0/Q5_1/Q8_0 at 8 bits
    # (cpu kernels, bf16); auto = q4 for a Q4_0/Q4_1/Q4_K/Q5_0/Q5_1 file, else int8, where
    # the cpu kernels run them fast on a bf16 model, else dtype.
    weights: str = "dtype"
    # K/V cache storage: dtype = the model dtype; int8 = 8-bit values with a float32 scale
    # per token and KV head (about half the bytes, so twice the tokens in the same memory).
    kv_dtype: str = "dtype"
    device: str = "auto"  # auto = cuda when available (ROCm too), else cpu
    num_threads: int = 0  # CPU threads for torch; 0 = torch's default
    prefix_cache: bool = True
    # The prefix cache on disk (engine/disk_cache.py): the K/V of prompts of at least
    # disk_cache_min_tokens, kept across restarts in lucedesk's cache folder, all models'
    # together at most disk_cache_gb (the least recently used go first); 0 = none.
    disk_cache_gb: float = 0.0
    # The weights as the CPU kernels hold them (repacked from a GGUF file's blocks), kept
    # in lucedesk's cache folder and mapped at later starts (engine/weight_cache.py), all
    # models' together at most weight_cache_gb; 0 = packed at every start.
    weight_cache_gb: float = 0.0
    disk_cache_min_tokens: int = 1024
    # Prompt-lookup speculation (engine/speculation.py): the default for requests that do
    # not say, and the longest draft a step verifies for one request.
    prompt_lookup: bool = False
    prompt_lookup_tokens: int = 8
    # While an interactive request decodes (the focused pane, an HTTP request that asks),
    # background requests (subagents, fan-out, other clients) join one step in this many:
    # the one a person watches keeps its pace, and no background request stops.
    background_every: int = 10

    def validate(self, source: str = "engine config") -> EngineConfig:
        def fail(key: str, rule: str) -> ConfigError:
            return ConfigError(f"{source}: {key} {rule} (got {getattr(self, key)!r})")

        positive = (
            "background_every",
            "max_slots",
            "block_size",
            "max_num_batched_tokens",
            "prefill_chunk_idle",
            "prefill_chunk_decoding",
            "max_waiting",
        )
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise fail(key, "must be a positive integer")
        lookup = self.prompt_lookup_tokens
        if not isinstance(lookup, int) or isinstance(lookup, bool) or not 1 <= lookup <= 64:
            raise fail("prompt_lookup_tokens", "must be an integer from 1 to 64")
        for key in (
            "kv_pool_tokens",
            "max_model_len",
            "num_threads",
            "decode_headroom_tokens",
            "activation_reserve_mb",
            "decode_step_ms",
            "disk_cache_min_tokens",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise fail(key, "must be an integer >= 0")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise fail("block_size", "must be one of 8, 16, 32, 64, 128")
        if self.max_num_batched_tokens < self.max_slots:
            raise fail("max_num_batched_tokens", f"must be at least max_slots ({self.max_slots})")
        slowdown = self.decode_slowdown
        if not isinstance(slowdown, int | float) or not (slowdown == 0 or slowdown > 1):
            raise fail("decode_slowdown", "must be 0 (fixed chunks) or a number above 1")
        for key in ("disk_cache_gb", "weight_cache_gb", "device_memory_gb"):
            size = getattr(self, key)
            if not isinstance(size, int | float) or isinstance(size, bool) or size < 0:
                zero = "none" if key == "device_memory_gb" else "no cache on disk"
                raise fail(key, f"must be a number of GB >= 0 (0: {zero})")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise fail("kv_memory_fraction", "must be in (0, 0.95]")
        if self.dtype not in DTYPES:
            raise fail("dtype", f"must be one of {', '.join(DTYPES)}")
        if self.kernels not in KERNELS:
            raise fail("kernels", f"must be one of {', '.join(KERNELS)}")
        if self.weights not in WEIGHTS:
            raise fail("weights", f"must be one of {', '.join(WEIGHTS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise fail("kv_dtype", f"must be one of {', '.join(KV_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise fail("device", "must be auto, cpu, cuda or cuda:N")
        return self

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(EngineConfig))
