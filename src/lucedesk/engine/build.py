"""Putting an engine together from a model path and an EngineConfig."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lucedesk.catalog.fingerprint import model_fingerprint
from lucedesk.catalog.fit import check_fits, kv_bytes_per_token, pool_basis
from lucedesk.config import EngineConfig
from lucedesk.engine import weight_cache
from lucedesk.engine.device import resolve_device, resolve_dtype
from lucedesk.engine.disk_cache import DiskPrefixCache, disk_cache_root, model_key
from lucedesk.engine.engine import Engine, ModelInfo
from lucedesk.engine.memory import available_memory, dtype_name, return_free_memory
from lucedesk.engine.models.decoder import DecoderModel, Projection
from lucedesk.engine.models.expert_weights import (
    experts_fit,
    materialize_dense,
    quantize_experts,
)
from lucedesk.engine.models.gguf_blocks import LOW_BIT_TYPES
from lucedesk.engine.models.loader import LoadedModel, load_model
from lucedesk.engine.runner import TorchSeqEngine
from lucedesk.engine.scheduler import Scheduler
from lucedesk.engine.weight_cache import (  # noqa: F401 (the front door's)
    wait_for_writers,
    weight_cache_root,
)
from lucedesk.errors import ConfigError
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
    from lucedesk.catalog.summary import summarize_path

    device = check_device(config)
    dtype = resolve_dtype(config.dtype, device)
    if config.num_threads and device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    path = Path(model_path).expanduser()
    if check_fit and path.exists():  # a missing one is the loader's to report
        free = available_memory(device, config.unified_memory)
        what = name or path.name
        check_fits(summarize_path(path), config, device.type, dtype_name(dtype), free, what)
    # Held weights from an earlier start, mapped (engine/weight_cache.py), where kept.
    cache = held_weights_file(path, config, device, dtype)
    if cache is not None:
        weight_cache.sweep(cache.parent)
    cached = cache is not None and cache.is_file()
    read = dict(name=name, chat_template=chat_template, lazy_experts=True)
    loaded = load_model(path, dtype, read_weights=not cached, **read)
    if cached and not weight_cache.load(loaded.model, cache):
        cached = False
        loaded = load_model(path, dtype, **read)
    # A GGUF mixture's experts stay in the file until their format is chosen (assemble).
    loaded.model.to(device)
    built = assemble(loaded, config, device)
    if cache is not None and not cached and built.weights in ("q4", "int8"):
        weight_cache.save_in_background(loaded.model, cache, config.weight_cache_gb)
    return built


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
        engine, loaded, device, model.dtype, pool_tokens, kernels, weights, pool_bytes, basis
    )


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


def apply_weight_format(model: DecoderModel, wanted: str, kernels: str) -> str:
    """Puts the matmul weights in the configured format; returns the format in use.

    Decode streams every weight each step, so fewer bytes a weight is speed. Both formats
    run in the C++ CPU kernels on bf16 activations:
    - q4: a GGUF file's blocks as they are: 4-bit ones (Q4_0, Q4_1, Q4_K) at 4 bits, 0.5625
      to 0.75 bytes a weight; Q5_0, Q5_1 and Q8_0 ones (and a fused weight with such a
      part) at 8 bits, 1.125 bytes where the scales are float16 (1.0625 for Q8_0's, whose m
      is implied; 1.25 where a Q4_K part's are not); Q6_K ones at 6 bits, 0.83 bytes (their
      int8 scales per sixteen inputs as they are); a weight in any other type (Q5_K,
      float, or Q6_K fused with another type) at 8 bits from its values, 1.25 bytes
      (`_maker` logs which were held how);
    - int8: an affine scale per 32 inputs, 1.125 to 1.25 bytes a weight (the file's levels
      where its blocks are grids, as for q4 but all at 8 bits), on the VNNI kernels
      wherever they run; on AMX tiles only where they do not: the tile kernel widens every
      weight to bfloat16 each call, which a long prompt's rows share (a 2,048-token prompt
      ~15% faster) and one decode row pays alone (a step twice as long), and the layer
      stack (kernels/cpu_stack.py) takes the VNNI kernels' weights only.
    `auto` takes q4 where the VNNI kernels run for a file in Q4_0, Q4_1, Q4_K, Q5_0 or
    Q5_1; else int8 where VNNI or AMX tiles run it fast, else the model dtype. A mixture's
    experts take the same format (expert_weights.py: the file's own 4-bit, MXFP4 or 8-bit
    levels where it has them)."""
    from lucedesk.kernels.quantized import (
        LowBitWeight,
        int8_tiles_available,
        lowbit_vector_available,
    )

    usable = kernels == "cpu" and model.dtype == torch.bfloat16
    weights = model.projection_weights()
    if wanted == "auto" and model.weight_format != "dtype":
        wanted = model.weight_format  # already chosen (an engine rebuilt on the same weights)
    if wanted == "auto":
        whole = all(LowBitWeight.fits(tuple(w.shape)) for w in weights) and experts_fit(model)
        if usable and whole and lowbit_vector_available() and _low_bit_file(model):
            wanted = "q4"
        elif usable and whole and (int8_tiles_available() or lowbit_vector_available()):
            wanted = "int8"
        else:
            wanted = "dtype"
    if wanted == model.weight_format:
        if wanted == "dtype" and model.expert_source is not None:
            materialize_dense(model)  # experts left in the file until now
        return wanted
    if wanted not in ("int8", "q4"):
        raise ConfigError(
            f"the loaded model's weights are {model.weight_format}; load it again for {wanted!r}"
        )
    if not usable:
        raise ConfigError(
            f"weights {wanted!r} need the cpu kernels and a bfloat16 model "
            f"(kernels {kernels}, dtype {str(model.dtype).removeprefix('torch.')})"
        )
    odd = [tuple(w.shape) for w in weights if w.shape[1] % LowBitWeight.GROUP]
    odd += [] if experts_fit(model) else ["experts' weights"]
    if odd:
        raise ConfigError(
            f"weights {wanted!r} need matmul inputs in multiples of {LowBitWeight.GROUP} "
            f"(this model has {odd[0]})"
        )
    if wanted == "q4" and not _low_bit_file(model):
        raise ConfigError(
            "weights 'q4' need a GGUF file whose projections are in a 4- or 5-bit type "
            f"({', '.join(LOW_BIT_TYPES)}; a mixture's experts also MXFP4); "
            f"this model's are {_first_type(model) or 'not from a GGUF file'}"
        )
    started = time.perf_counter()
    model.quantize(wanted, _maker(model, wanted))
    quantize_experts(model, wanted)
    log.info("weights held as %s in %.1f s", wanted, time.perf_counter() - started)
    return wanted


def _first_type(model: DecoderModel) -> str | None:
    """The type of the first layer's MLP weights in the file (its experts' in a mixture)."""
    if model.layers[0].moe is not None and model.expert_source is not None:
        return model.expert_source.type_name(0, "gate_up")
    source = model.block_source
    return None if source is None else source(0, "gate_up_proj").type_name


def _low_bit_file(model: DecoderModel) -> bool:
    """Whether the file holds the first layer's MLP weights in a 4- or 5-bit type
    (LOW_BIT_TYPES), or in MXFP4 for a mixture's experts."""
    if model.layers[0].moe is not None:
        return _first_type(model) in (*LOW_BIT_TYPES, "MXFP4")
    source = model.block_source
    return source is not None and all(t in LOW_BIT_TYPES for t in source(0, "gate_up_proj").types)


def _maker(
    model: DecoderModel, wanted: str
) -> Callable[[int | None, str, torch.Tensor], Projection]:
    """Each weight as the file's levels where its blocks are grids (FileBlocks.bits): for
    q4 at 4 bits where every part is in a 4-bit type, at 6 where every part is Q6_K, else
    (and for int8) at 8 bits, the scales float16 where the file's are (int8 takes a Q6_K
    weight from its values); any other weight at 8 bits from its values. int8 where the
    VNNI kernels do not run (Int8Weight: on AMX tiles, or in plain rows) takes every weight
    from its values. One notice (the LM head comes last) says how many weights were held
    which way, by type."""
    from lucedesk.kernels.quantized import Int8Weight, LowBitWeight, lowbit_vector_available

    source = model.block_source
    low_bit = wanted == "q4" or lowbit_vector_available()
    held: dict[tuple[str, str], int] = {}

    def make(layer: int | None, proj: str, w: torch.Tensor) -> Projection:
        blocks = None if source is None else source(layer, proj)
        if not (low_bit and LowBitWeight.fits(w.shape)):
            made: Projection = Int8Weight(w)
            how = "at 8 bits from their values"
        elif (
            blocks is not None and blocks.bits is not None and (wanted == "q4" or blocks.bits != 6)
        ):
            bits = blocks.bits if wanted == "q4" else 8
            levels, d, m, *factors = blocks.levels
            made = LowBitWeight(levels, d, m, bits=bits, factors=tuple(factors) or None)
            how = f"at {bits} bits as the file's levels"
        else:
            made = LowBitWeight.from_float(w)
            how = "at 8 bits from their values"
        kinds = blocks.types if blocks is not None else [str(w.dtype).removeprefix("torch.")]
        kind = "+".join(dict.fromkeys(kinds))
        held[how, kind] = held.get((how, kind), 0) + 1
        if layer is None:
            ways = "; ".join(f"{n} {how} ({kind})" for (how, kind), n in sorted(held.items()))
            log.info("weights %s: matmul weights held %s", wanted, ways)
        return made

    return make
