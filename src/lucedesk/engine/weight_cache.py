"""Held weights kept on disk: a model's weights as the CPU kernels hold them (the file's
levels repacked for the low-bit kernels, other weights at 8 bits, a mixture's experts
grouped), written once after the first load and mapped, not read or packed again, at every
later start.

Packing costs most of a start on a GGUF file: its tensors dequantized in Python (a Q6_K
tensor's levels, whatever the held format) and requantized, every expert repacked one at a
time (5 s of a 6.4 s start on a 949M Qwen3-MoE in Q4_K_M here). A cached file is a torch
zip mapped with `torch.load(mmap=True)`: its pages come in as the kernels first read them,
and are the page cache's to drop again.

The file's name holds the model files' fingerprint (catalog/fingerprint.py) and everything
else that decides the held form: the weight setting, the CPU's kernel paths (VNNI, AMX
tiles), the dtype, the lucedesk version and a digest of the modules that read and pack the
weights (PACKERS), so a change to any of them makes older files foreign. Files that fail to
load are removed and the weights packed again; all of them together stay under
`weight_cache_gb`, least recently used out first (a held form larger than that is not
written).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from lucedesk.catalog.fingerprint import model_fingerprint
from lucedesk.engine.models.decoder import DecoderModel

log = logging.getLogger(__name__)

SUFFIX = ".weights.pt"
# The modules whose code decides what the held weights hold: how a file's blocks are read,
# how levels and scales are packed, which weights take which form.
PACKERS = (
    "lucedesk.engine.models.gguf_blocks",
    "lucedesk.engine.models.gguf_file",
    "lucedesk.engine.models.expert_weights",
    "lucedesk.engine.models.weights",
    "lucedesk.engine.build",
    "lucedesk.engine.held_weights",
    "lucedesk.engine.formats.cpu_levels",
    "lucedesk.catalog.held_formats",
    "lucedesk.kernels.blocks",
    "lucedesk.kernels.quantized",
    "lucedesk.kernels.levels",
    "lucedesk.kernels.scales",
    "lucedesk.kernels.held_state",
)
_writing: set[Path] = set()  # files a thread of this process is writing
_writers: list[threading.Thread] = []


@functools.cache
def packing_digest() -> str:
    """A digest of PACKERS' source files."""
    digest = hashlib.sha256()
    for name in PACKERS:
        spec = importlib.util.find_spec(name)
        digest.update(Path(spec.origin).read_bytes() if spec and spec.origin else name.encode())
    return digest.hexdigest()[:16]


def weight_cache_root() -> Path:
    """LUCEDESK_WEIGHT_CACHE, else the folder weights in lucedesk's cache folder."""
    from platformdirs import user_cache_dir

    if os.environ.get("LUCEDESK_WEIGHT_CACHE"):
        return Path(os.environ["LUCEDESK_WEIGHT_CACHE"]).expanduser()
    return Path(user_cache_dir("lucedesk")) / "weights"


def cache_file(model_path: Path, weights: str, dtype: torch.dtype) -> Path:
    """Where the held weights of this model, weight setting and dtype on this CPU live."""
    from lucedesk import __version__
    from lucedesk.engine.held_weights import cpu_paths

    paths = sorted(cpu_paths())  # the C++ kernels' paths the held-format rule went by
    key = "|".join(map(str, (weights, dtype, paths, __version__, packing_digest())))
    tail = hashlib.sha256(key.encode()).hexdigest()[:16]
    return weight_cache_root() / f"{model_fingerprint(model_path)[:32]}-{tail}{SUFFIX}"


def held_state(model: DecoderModel) -> dict:
    """The model's parameters that hold values and its held weights, as tensors and the
    attributes that rebuild them."""
    from lucedesk.kernels.held_state import packed_state

    params = {name: p.data for name, p in model.named_parameters() if p.numel()}
    held = {}
    for i, layer in enumerate(model.layers):
        for proj, weight in layer.quantized.items():
            held[f"layers.{i}.{proj}"] = packed_state(weight)
        if layer.moe is not None:
            for proj, weight in layer.moe.experts.quantized.items():
                held[f"layers.{i}.experts.{proj}"] = packed_state(weight)
    if model.lm_head_quantized is not None:
        held["lm_head"] = packed_state(model.lm_head_quantized)
    return {"format": model.weight_format, "params": params, "held": held}


def restore(model: DecoderModel, state: dict) -> None:
    """The model's weights from `held_state`'s dict: parameters the state does not hold
    are emptied (they were released when the weights were packed)."""
    from lucedesk.kernels.held_state import from_packed_state

    params = state["params"]
    for name, p in model.named_parameters():
        value = params.get(name)
        if value is not None and (value.shape != p.shape or value.dtype != p.dtype):
            raise ValueError(f"{name}: {tuple(value.shape)} {value.dtype} in the cache")
        p.data = value if value is not None else torch.empty(0, dtype=p.dtype)
    for key, (tensors, attrs) in state["held"].items():
        weight = from_packed_state(tensors, attrs)
        parts = key.split(".")
        if key == "lm_head":
            model.lm_head_quantized = weight
        elif parts[2] == "experts":
            model.layers[int(parts[1])].moe.experts.quantized[parts[3]] = weight
        else:
            model.layers[int(parts[1])].quantized[parts[2]] = weight
    model.weight_format = state["format"]


def load(model: DecoderModel, file: Path) -> bool:
    """Whether the model's weights came from `file` (mapped). A file that does not load or
    does not fit this model is removed, with a log line."""
    if not file.is_file():
        return False
    started = time.perf_counter()
    try:
        restore(model, torch.load(file, mmap=True, weights_only=True))
    except Exception as exc:  # a cut, damaged or foreign file: packed again, and replaced
        log.warning("weight cache: %s not used (%s); removed", file.name, exc)
        file.unlink(missing_ok=True)
        return False
    with contextlib.suppress(OSError):
        os.utime(file)  # recently used
    log.info("weights held as %s, mapped from %s in %.2f s", model.weight_format, file,
             time.perf_counter() - started)  # fmt: skip
    return True


def save_in_background(model: DecoderModel, file: Path, limit_gb: float) -> None:
    """Writes the held weights to `file` on a thread (a temporary file, renamed when whole),
    then keeps the folder under `limit_gb`; nothing where they alone exceed it or a thread
    of this process writes that file already. The tensors are the engine's own: they are
    never written once packed. `wait_for_writers` lets a process that exits finish them; one
    killed meanwhile leaves a temporary file that a later start removes (`sweep`)."""
    state = held_state(model)
    parts = [state["params"], *(tensors for tensors, _ in state["held"].values())]
    size = sum(t.nbytes for part in parts for t in part.values())
    if size > limit_gb * 1e9 or file in _writing:
        return
    _writing.add(file)

    def write() -> None:
        started = time.perf_counter()
        partial = None
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            handle, name = tempfile.mkstemp(
                prefix=f"{file.name}.", suffix=".partial", dir=file.parent
            )
            os.close(handle)
            partial = Path(name)
            torch.save(state, partial)
            partial.replace(file)
            partial = None
            log.info("weight cache: %s written in %.1f s", file, time.perf_counter() - started)
            evict(file.parent, limit_gb, keep=file)
        except Exception as exc:  # a full disk, a folder that went away: packed next time
            log.warning("weight cache: %s not written (%s)", file, exc)
        finally:
            if partial is not None:
                partial.unlink(missing_ok=True)
            _writing.discard(file)

    thread = threading.Thread(target=write, name="lucedesk-weight-cache", daemon=True)
    _writers.append(thread)
    thread.start()


def wait_for_writers(say=None) -> None:
    """Until the held weights being written are whole (a process about to exit calls this);
    `say` is told once if there is something to wait for."""
    running = [t for t in _writers if t.is_alive()]
    if running and say is not None:
        say("keeping the weights as held for the next start...")
    for thread in running:
        thread.join()
    _writers.clear()


def sweep(folder: Path, older_than_s: float = 600) -> None:
    """Temporary files of writes that did not end (a start killed while writing), older than
    `older_than_s`: removed."""
    now = time.time()
    with contextlib.suppress(OSError):
        for path in folder.glob(f"*{SUFFIX}.*.partial"):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > older_than_s:
                    path.unlink()


def evict(folder: Path, limit_gb: float, keep: Path | None = None) -> None:
    """The least recently used files out until the rest fit `limit_gb` (never `keep`), and
    stale temporary files (`sweep`)."""
    sweep(folder)
    entries = []
    for path in folder.glob(f"*{SUFFIX}"):
        with contextlib.suppress(OSError):
            stat = path.stat()
            entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit_gb * 1e9:
            break
        if path != keep:
            with contextlib.suppress(OSError):
                path.unlink()
                log.info("weight cache: %s removed (least recently used)", path.name)
            total -= size
