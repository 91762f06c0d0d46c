"""Putting an engine together from a model path and an EngineConfig."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lucedesk.config import EngineConfig
from lucedesk.engine.engine import Engine, ModelInfo
from lucedesk.engine.models.llama import LlamaModel, ModelConfig
from lucedesk.engine.models.loader import LoadedModel, load_model
from lucedesk.engine.runner import TorchSeqEngine
from lucedesk.engine.scheduler import Scheduler
from lucedesk.errors import ConfigError
from lucedesk.kernels import resolve_kernels

log = logging.getLogger(__name__)

MIB = 1 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    # AVX512-BF16 / AMX hardware: oneDNN runs bf16 matmuls natively there.
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """K and V, every layer, every KV head."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype.itemsize


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
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, free_bytes: int, max_len: int
) -> int:
    """KV capacity in tokens: the configured number, or `kv_memory_fraction` of the free
    memory; never more than every slot at full context, and whole blocks only."""
    cap = config.max_slots * max_len
    if config.kv_pool_tokens:
        tokens = config.kv_pool_tokens
    else:
        tokens = min(
            int(free_bytes * config.kv_memory_fraction) // kv_bytes_per_token(model, dtype), cap
        )
    return tokens // config.block_size * config.block_size


@dataclass(slots=True)
class BuiltEngine:
    engine: Engine
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    pool_tokens: int
    kernels: str
    weights: str


def build_engine(model_path: str | Path, config: EngineConfig) -> BuiltEngine:
    config.validate()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.num_threads and device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    loaded = load_model(model_path, dtype)
    loaded.model.to(device)
    return assemble(loaded, config, device)


def kernel_build_notice(config: EngineConfig) -> str | None:
    """A line to show before starting when this start will compile the CPU kernels (the
    first run on a machine, ~10 s), else None."""
    if config.kernels not in ("auto", "cpu") or resolve_device(config.device).type != "cpu":
        return None
    from lucedesk.kernels.cpu import needs_build

    if not needs_build():
        return None
    return "building the CPU kernels (first run on this machine, ~10 s)"


def launch_engine(model_path: str | Path, config: EngineConfig) -> BuiltEngine:
    """Load the model and run the engine on one new thread, returning once it is serving.

    Every torch call of the engine happens on that thread, loading included: with OpenMP,
    a second thread running torch ops after the loading thread ran slower by half
    (62 vs 31 ms per decode step on 2 cores), two thread teams fighting for the cores."""
    ready: queue.Queue[BuiltEngine | BaseException] = queue.Queue()

    def serve() -> None:
        try:
            built = build_engine(model_path, config)
        except BaseException as exc:  # handed to the caller, who reports it
            ready.put(exc)
            return
        ready.put(built)
        built.engine.run_forever()

    thread = threading.Thread(target=serve, name="lucedesk-engine", daemon=True)
    thread.start()
    result = ready.get()
    if isinstance(result, BaseException):
        raise result
    result.engine.adopt_thread(thread)
    result.engine.warm_up()
    return result


def assemble(loaded: LoadedModel, config: EngineConfig, device: torch.device) -> BuiltEngine:
    """An engine around an already loaded model (a profile switch reuses the weights)."""
    model = loaded.model
    max_len = min(
        config.max_model_len or loaded.config.max_position_embeddings,
        loaded.config.max_position_embeddings,
    )
    pool_tokens = derive_pool_tokens(
        config, loaded.config, model.dtype, available_memory(device, config.unified_memory), max_len
    )
    num_blocks = max(pool_tokens // config.block_size, 1)
    kernels = resolve_kernels(config.kernels, device)
    weights = apply_weight_format(model, config.weights, kernels)
    runner = TorchSeqEngine(model, num_blocks, config.block_size, kernels, device)
    scheduler = Scheduler(config, num_blocks, max_len)
    engine = Engine(runner, scheduler, loaded.tokenizer, loaded.name, config.max_waiting)
    engine.model_info = ModelInfo(
        loaded.name,
        str(loaded.path),
        loaded.config.architecture,
        loaded.quantization,
        max_len,
    )
    log.info(
        "engine: %s on %s (%s, %s weights), %d slots, KV pool %d tokens (%d MiB), %s kernels",
        loaded.name,
        device,
        str(model.dtype).removeprefix("torch."),
        weights,
        config.max_slots,
        pool_tokens,
        pool_tokens * kv_bytes_per_token(loaded.config, model.dtype) // MIB,
        kernels,
    )
    return BuiltEngine(engine, loaded, device, model.dtype, pool_tokens, kernels, weights)


def apply_weight_format(model: LlamaModel, wanted: str, kernels: str) -> str:
    """Puts the matmul weights in the configured format; returns the format in use.

    int8 (weight-only, an affine scale per 32 inputs) runs in the C++ CPU kernels on bf16
    activations: fewer bytes than bf16 for decode steps, which stream every weight."""
    from lucedesk.kernels.cpu import Int8Weight, int8_tiles_available

    usable = kernels == "cpu" and model.dtype == torch.bfloat16
    weights = model.projection_weights()
    if wanted == "auto":  # only where AMX tiles make int8 fast; elsewhere it runs, slowly
        fast = usable and int8_tiles_available()
        fast = fast and all(Int8Weight.fits(tuple(w.shape)) for w in weights)
        wanted = "int8" if fast else "dtype"
    if wanted == model.weight_format:
        return wanted
    if wanted == "int8":
        if not usable:
            raise ConfigError(
                "weights 'int8' need the cpu kernels and a bfloat16 model "
                f"(kernels {kernels}, dtype {str(model.dtype).removeprefix('torch.')})"
            )
        odd = [tuple(w.shape) for w in weights if w.shape[1] % Int8Weight.GROUP]
        if odd:
            raise ConfigError(
                f"weights 'int8' need matmul inputs in multiples of {Int8Weight.GROUP} "
                f"(this model has {odd[0]})"
            )
        started = time.perf_counter()
        model.quantize("int8", Int8Weight)
        log.info("weights quantized to int8 in %.1f s", time.perf_counter() - started)
        return wanted
    raise ConfigError(
        f"the loaded model's weights are {model.weight_format}; load it again for {wanted!r}"
    )
