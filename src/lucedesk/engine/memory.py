"""The memory of this machine as the engine meets it: what is free for the KV pool on a
device, handing the C heap's free pages back, and a Fit (catalog/fit.py: whether a model
fits, reckoned from its file) for the device and memory a profile has here now."""

from __future__ import annotations

from pathlib import Path

import torch

from lucedesk.catalog.fit import Fit
from lucedesk.catalog.quants import LOADABLE
from lucedesk.catalog.summary import ModelSummary
from lucedesk.config import EngineConfig
from lucedesk.engine.device import resolve_device, resolve_dtype
from lucedesk.errors import ConfigError


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as catalog/fit.py names it: "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def available_memory(device: torch.device, unified: bool = False) -> int:
    """Bytes free for the KV pool now (after the weights are in place): `memory_basis`'s."""
    return memory_basis(device, unified)[0]


def memory_basis(device: torch.device, unified: bool = False) -> tuple[int, str]:
    """Bytes free on the device now, and which number that is. On a unified-memory APU
    (Strix Halo) the GPU allocates from system RAM: its driver's free count (which on
    recent ROCm adds the GTT beyond the BIOS's carve-out, so it can exceed the total it
    reports) and the system's available memory, the smaller of the two."""
    if device.type != "cuda":
        system = _system_available()
        return system, f"{_gib(system)} of system memory available"
    if not torch.cuda.is_available():
        raise ConfigError(f"device {device}: this machine's torch sees no GPU")
    free, total = (int(v) for v in torch.cuda.mem_get_info(device))
    said = f"{_gib(free)} free by the GPU's driver (of {_gib(total)} it reports"
    said += ": GTT beyond its carve-out)" if free > total else ")"
    if not unified:
        return free, said
    system = _system_available()
    smaller = "that" if free <= system else "the system's"
    return min(free, system), f"{said}, {_gib(system)} of system memory available: {smaller}"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def _system_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


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


def unreadable(summary: ModelSummary) -> str | None:
    """Why the engine cannot read the model at all (its kind, its tensor types), or None."""
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
    return None


def fit_now(config: EngineConfig, given_back: int = 0) -> Fit:
    """Whether models fit the device `config` names, with the memory free there now (and
    `given_back`: what a running engine frees on a switch); on a machine without that GPU,
    by the profile's own `device_memory_gb` where it has one (else the ConfigError)."""
    device = resolve_device(config.device)
    try:
        free = available_memory(device, config.unified_memory) + given_back
    except ConfigError as exc:
        if not config.device_memory_gb:
            raise
        free = int(config.device_memory_gb * 2**30)
        dtype = "bfloat16" if config.dtype == "auto" else config.dtype
        what = f"{config.device_memory_gb:g} GiB, the profile's device's (this machine: {exc})"
        return Fit(config, device.type, dtype, free, unreadable, where=what)
    dtype = dtype_name(resolve_dtype(config.dtype, device))
    return Fit(config, device.type, dtype, free, unreadable)
