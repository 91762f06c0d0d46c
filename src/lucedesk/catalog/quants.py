"""A GGUF repository's quants: each model file (or set of split parts) with its quant label,
read from the file name as llama.cpp and Ollama read it, and the choice of one."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lucedesk.catalog.gguf_header import SPLIT_NAME

# A quant label in a file name: Q4_K_M, IQ4_XS, UD-Q4_K_XL, MXFP4, BF16... standing alone
# between separators (the last one in the name counts).
_LABEL = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q[1-8](?:_[0-9A-Z]+)*|TQ[12]_0|BF16|F16|F32|MXFP4(?:_MOE)?))"
    r"(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# Files in GGUF repositories that are not language models.
_NOT_MODELS = re.compile(r"mmproj|imatrix|(?:^|/)mtp-", re.IGNORECASE)

# Labels whose every tensor is in a type lucedesk loads (held_formats.READ_TYPES): the
# K-quants' _S/_M/_L mixes use Q4_K..Q8_0, IQ4_XS files Q5_K..Q8_0 beside it; Q2_K, Q3_K,
# the other IQ types and the TQ types are not read.
LOADABLE = {
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K", "Q6_K_L",
    "Q4_K_S", "Q4_K_M", "Q4_K_L", "Q5_K_S", "Q5_K_M", "Q5_K_L",
    "IQ4_NL", "IQ4_XS", "MXFP4", "MXFP4_MOE", "BF16", "F16", "F32",
}  # fmt: skip
UNQUANTIZED = {"BF16", "F16", "F32"}
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp and Ollama take where nothing is said


def label_type(label: str) -> str:
    """The GGUF type most of a quant's weights are in, from its label: Q4_K_M -> Q4_K,
    UD-Q4_K_XL -> Q4_K, MXFP4_MOE -> MXFP4, IQ4_XS -> IQ4_XS; "" where it names none."""
    label = label.upper().removeprefix("UD-")
    match = re.match(r"(I?Q[1-8]_(?:K|[0-9]|NL|XS|XXS|S|M)|MXFP4|BF16|F16|F32|TQ[12]_0)", label)
    return match[1] if match else ""


def quant_label(path: str) -> str | None:
    """The quant a GGUF file is named for (upper case), its folder's where its name has none."""
    parts = path.split("/")
    for part in reversed(parts[-2:]):
        found = _LABEL.findall(part.removesuffix(".gguf"))
        if found:
            return found[-1].upper()
    return None


@dataclass(slots=True, frozen=True)
class Quant:
    label: str  # Q4_K_M, or the file's name where it names no quant
    files: tuple[str, ...]  # paths in the repository; a split model's parts in order
    size: int  # bytes, all parts

    @property
    def loadable(self) -> bool:
        return self.label in LOADABLE

    @property
    def split(self) -> bool:
        return len(self.files) > 1


def quants_of(files: Iterable[tuple[str, int]]) -> list[Quant]:
    """The models among a repository's (path, size) files: single GGUFs and complete sets of
    split parts, smallest first. Parts of an incomplete set are left out."""
    singles: list[Quant] = []
    sets: dict[tuple[str, int], dict[int, tuple[str, int]]] = {}
    for path, size in files:
        if not path.endswith(".gguf") or _NOT_MODELS.search(path):
            continue
        folder, _, name = path.rpartition("/")
        split = SPLIT_NAME.match(name)
        if split is None:
            label = quant_label(path) or name.removesuffix(".gguf")
            singles.append(Quant(label, (path,), size))
            continue
        key = (f"{folder}/{split['prefix']}" if folder else split["prefix"], int(split["count"]))
        sets.setdefault(key, {})[int(split["no"])] = (path, size)
    for (prefix, count), parts in sets.items():
        if sorted(parts) != list(range(1, count + 1)):
            continue
        ordered = [parts[i] for i in range(1, count + 1)]
        label = quant_label(ordered[0][0]) or prefix.rpartition("/")[2]
        singles.append(Quant(label, tuple(p for p, _ in ordered), sum(s for _, s in ordered)))
    return sorted(singles, key=lambda q: (q.size, q.label))


def find_quant(quants: list[Quant], wanted: str) -> Quant | None:
    """The quant a user named, matched without case: its label, else the one file or set
    whose path holds the name followed by '.', '-' or '/' (as llama.cpp matches)."""
    low = wanted.lower()
    for q in quants:
        if q.label.lower() == low:
            return q
    near = re.compile(re.escape(low) + r"[.\-/]")
    matches = [q for q in quants if any(near.search(f.lower()) for f in q.files)]
    return matches[0] if len(matches) == 1 else None


def choose_quant(quants: list[Quant], fits: Callable[[Quant], bool] | None) -> Quant | None:
    """With nothing named: the largest loadable quant that fits (`fits` None: none is known
    to), unquantized files only where the repository has no quantized one; else Q4_K_M,
    else the smallest loadable one."""
    loadable = [q for q in quants if q.loadable]
    quantized = [q for q in loadable if q.label not in UNQUANTIZED] or loadable
    if fits is not None:
        fitting = [q for q in quantized if fits(q)]
        if fitting:
            return fitting[-1]
    default = next((q for q in quantized if q.label == DEFAULT_QUANT), None)
    return default or (quantized[0] if quantized else None)


def describe(quants: list[Quant]) -> str:
    """The repository's quants with their sizes, for a message."""
    return ", ".join(f"{q.label} ({human_size(q.size)})" for q in quants) or "none"


def human_size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
