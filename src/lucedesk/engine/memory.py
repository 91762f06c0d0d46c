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
    """Bytes free for the KV pool now (after the weights are in place). On a unified-memory
    APU the GPU allocates from system RAM, so the smaller of the two counts."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device}: this machine's torch sees no GPU")
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
    `given_back`: what a running engine frees on a switch)."""
    device = resolve_device(config.device)
    free = available_memory(device, config.unified_memory) + given_back
    dtype = dtype_name(resolve_dtype(config.dtype, device))
    return Fit(config, device.type, dtype, free, unreadable)
