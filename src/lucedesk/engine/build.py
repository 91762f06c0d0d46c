"""Putting an engine together from a model path and an EngineConfig."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lucedesk.catalog.fingerprint import model_fingerprint
from lucedesk.catalog.fit import check_fits, kv_bytes_per_token, pool_basis
from lucedesk.catalog.held_formats import HeldFormat, choose
from lucedesk.catalog.summary import ModelSummary, summarize_path
from lucedesk.config import EngineConfig
from lucedesk.engine import weight_cache
from lucedesk.engine.device import resolve_device, resolve_dtype
from lucedesk.engine.disk_cache import DiskPrefixCache, disk_cache_root, model_key
from lucedesk.engine.engine import Engine, ModelInfo
from lucedesk.engine.held_weights import apply_weight_format, cpu_paths, describe
from lucedesk.engine.memory import available_memory, dtype_name, return_free_memory
from lucedesk.engine.models.loader import LoadedModel, load_model
from lucedesk.engine.runner import TorchSeqEngine
from lucedesk.engine.scheduler import Scheduler
from lucedesk.engine.weight_cache import (  # noqa: F401 (the front door's)
    wait_for_writers,
    weight_cache_root,
)
from lucedesk.errors import ConfigError, ModelLoadError
from lucedesk.kernels import resolve_kernels

log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(slots=True)
class BuiltEngine:
    engine: Engine
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    pool_tokens: int
    kernels: str
    weights: str
    pool_bytes: int = 0  # the KV pool's memory
    pool_basis: str = ""  # why the pool holds pool_tokens (catalog.fit.pool_basis)
    held: str = ""  # how the weights are held, by kind (held_weights.describe)


def check_device(config: EngineConfig) -> torch.device:
    """The device `config` names, if this machine has it: what a profile switch checks
    before it stops anything, and a start before it loads anything."""
    config.validate()
    device = resolve_device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        build = (
            "a CPU-only torch build"
            if torch.version.cuda is None and torch.version.hip is None
            else "torch"
        )
        raise ConfigError(
            f"device {config.device!r}: {build} ({torch.__version__}) sees no GPU on this machine"
        )
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {config.device!r}: this machine has {torch.cuda.device_count()} GPUs"
            )
    if config.kernels == "cpu" and device.type != "cpu":
        raise ConfigError(f"kernels 'cpu' run on the CPU, not on device {config.device!r}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if config.kernels == "triton" and device.type == "cpu" and not interpreted:
        raise ConfigError(
            "kernels 'triton' run on a GPU; on the CPU only in Triton's interpreter, slowly "
            "(to check the GPU kernels' arithmetic): start with TRITON_INTERPRET=1"
        )
    return device


def build_engine(
    model_path: str | Path,
    config: EngineConfig,
    name: str | None = None,
    chat_template: str | None = None,
    check_fit: bool = True,
) -> BuiltEngine:
    """The engine for a model file or folder; `name` is what it is called (its file's stem
    by default), `chat_template` replaces the file's own template. With `check_fit`, one
    that cannot fit the memory free is refused before it loads (catalog/fit.py)."""
    device = check_device(config)
    dtype = resolve_dtype(config.dtype, device)
    if config.num_threads and device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    path = Path(model_path).expanduser()
    summary = None  # a missing or unreadable one: the loader's to report
    if path.exists():
        try:
            summary = summarize_path(path)
        except ModelLoadError:
            if check_fit:
                raise
    if check_fit and summary is not None:
        free = available_memory(device, config.unified_memory)
        what = name or path.name
        check_fits(summary, config, device.type, dtype_name(dtype), free, what)
    # Held weights from an earlier start, mapped (engine/weight_cache.py), where kept.
    cache = held_weights_file(path, config, device, dtype)
    if cache is not None:
        weight_cache.sweep(cache.parent)
    cached = cache is not None and cache.is_file()
    # A GGUF file's matmul weights stay in it until their form is chosen (assemble), each
    # then read alone: as blocks, levels or dense, straight to the device.
    held = _expected_format(summary, config, device, dtype)
    read = dict(
        name=name, chat_template=chat_template, lazy_experts=True, lazy_weights=True,
        lazy_embedding=held is not None and held.embedding,
    )  # fmt: skip
    loaded = load_model(path, dtype, read_weights=not cached, **read)
    if cached and not weight_cache.load(loaded.model, cache):
        cached = False
        loaded = load_model(path, dtype, **read)
    loaded.model.to(device)
    built = assemble(loaded, config, device)
    if cache is not None and not cached and built.weights in ("q4", "int8"):
        weight_cache.save_in_background(loaded.model, cache, config.weight_cache_gb)
    return built


def _expected_format(
    summary: ModelSummary | None, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> HeldFormat | None:
    """The held format the rule gives for this file before it loads (what `assemble` will
    apply; None where it is the dtype or the setting cannot be met, which assemble says)."""
    if summary is None:
        return None
    kernels = resolve_kernels(config.kernels, device)
    paths = cpu_paths() if kernels == "cpu" else frozenset()
    try:
        return choose(config.weights, kernels, dtype_name(dtype), summary.mlp_type, paths)
    except ConfigError:
        return None


def held_weights_file(
    path: Path, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> Path | None:
    """Where a GGUF file's weights as the CPU kernels hold them are kept, or None where
    they are not (no weight cache, another device or kernels)."""
    if not (config.weight_cache_gb > 0 and device.type == "cpu" and path.is_file()):
        return None
    if resolve_kernels(config.kernels, device) != "cpu":
        return None
    return weight_cache.cache_file(path, config.weights, dtype)


def kernel_build_notice(config: EngineConfig) -> str | None:
    """A line to show before starting when this start will compile the CPU kernels (the
    first run on a machine: ~25 s on 2 idle cores, minutes on a loaded machine), else
    None."""
    if config.kernels not in ("auto", "cpu") or resolve_device(config.device).type != "cpu":
        return None
    from lucedesk.kernels.cpu_build import needs_build

    if not needs_build():
        return None
    return "building the CPU kernels (first run on this machine; a minute or so)"


def launch_engine(
    model_path: str | Path,
    config: EngineConfig,
    progress: Callable[[str], None] | None = None,
    name: str | None = None,
    chat_template: str | None = None,
    check_fit: bool = True,
) -> BuiltEngine:
    """Load the model and run the engine on one new thread, returning once it is serving.

    Every torch call of the engine happens on that thread, loading included: with OpenMP,
    a second thread running torch ops after the loading thread ran slower by half
    (62 vs 31 ms per decode step on 2 cores), two thread teams fighting for the cores."""
    ready: queue.Queue[BuiltEngine | BaseException] = queue.Queue()

    def serve() -> None:
        try:
            built = build_engine(model_path, config, name, chat_template, check_fit)
            return_free_memory()
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
    if progress is not None:
        progress(f"warming up ({result.kernels} kernels, {result.pool_tokens} KV tokens)")
    result.engine.warm_up()
    return result


def assemble(loaded: LoadedModel, config: EngineConfig, device: torch.device) -> BuiltEngine:
    """An engine around an already loaded model (a profile switch reuses the weights)."""
    model = loaded.model
    max_len = min(
        config.max_model_len or loaded.config.max_position_embeddings,
        loaded.config.max_position_embeddings,
    )
    kernels = resolve_kernels(config.kernels, device)
    # The weights take their final form first (a mixture's experts are read from the file
    # only now): the KV pool is sized from the memory left after them.
    weights = apply_weight_format(model, config.weights, kernels)
    dtype = dtype_name(model.dtype)
    free = available_memory(device, config.unified_memory)
    pool_tokens, basis = pool_basis(config, loaded.config, dtype, free, max_len)
    pool_bytes = pool_tokens * kv_bytes_per_token(loaded.config, dtype, config.kv_dtype)
    num_blocks = max(pool_tokens // config.block_size, 1)
    runner = TorchSeqEngine(model, num_blocks, config.block_size, kernels, device, config.kv_dtype)
    scheduler = Scheduler(config, num_blocks, max_len)
    info = ModelInfo(
        loaded.name, str(loaded.path), loaded.config.architecture, loaded.quantization, max_len
    )
    engine = Engine(runner, scheduler, loaded.tokenizer, info, config.max_waiting)
    engine.say_pool_basis(basis)
    if config.disk_cache_gb > 0 and config.prefix_cache:
        engine.disk = open_disk_cache(loaded, config, runner, weights, kernels)
    log.info(
        "engine: %s on %s (%s, %s weights), %d slots, KV pool %d tokens (%s; %d MiB, %s), "
        "%s kernels",
        loaded.name,
        device,
        str(model.dtype).removeprefix("torch."),
        weights,
        config.max_slots,
        pool_tokens,
        basis,
        pool_bytes // MIB,
        config.kv_dtype,
        kernels,
    )
    return BuiltEngine(
        engine, loaded, device, model.dtype, pool_tokens, kernels, weights, pool_bytes, basis,
        describe(model),
    )  # fmt: skip


def open_disk_cache(
    loaded: LoadedModel, config: EngineConfig, runner: TorchSeqEngine, weights: str, kernels: str
) -> DiskPrefixCache:
    """The prefix cache on disk for this model as the engine computes it: its files, device,
    dtype, KV dtype, weight format, kernels and block size name its folder."""
    started = time.perf_counter()
    key = model_key(
        model_fingerprint(loaded.path),
        runner.device.type,
        dtype_name(loaded.model.dtype),
        config.kv_dtype,
        weights,
        kernels,
        config.block_size,
    )
    disk = DiskPrefixCache(
        disk_cache_root(),
        key,
        runner.kv_layout(),
        config.block_size,
        int(config.disk_cache_gb * 1e9),
        config.disk_cache_min_tokens,
    )
    log.info("prefix cache on disk: %s (%.2f s)", disk.folder, time.perf_counter() - started)
    return disk
