"""A model's fingerprint: what its files hold, cheaply enough to take at every start.

The files' names, sizes, their first MiB (a GGUF's header and tensor table, a safetensors
file's header) and 16 MiB-sized pieces spread evenly through each are hashed: two files that
differ in their weights differ in nearly every piece, and reading 17 MiB of a 60 GB file
takes a fraction of a second where hashing it whole would take minutes. What keys caches
of things computed from the weights (the KV on disk).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from lucedesk.catalog.gguf_header import SPLIT_NAME, split_parts

PIECE = 1 << 20
PIECES = 16
_WEIGHTS = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def model_files(path: Path) -> list[Path]:
    """The files that hold a model: a file (every part of a split GGUF that is there), or
    a folder's weights and its config."""
    if path.is_dir():
        files = [p for p in path.iterdir() if p.suffix in _WEIGHTS or p.name == "config.json"]
        return sorted(f for f in files if f.is_file())
    split = SPLIT_NAME.match(path.name)
    if split and split["no"] == "00001":
        return [p for p in split_parts(path, int(split["count"])) if p.is_file()]
    return [path]


def model_fingerprint(path: str | Path) -> str:
    """A hex digest of the model's files (see the module's note); taken once per process
    while the files' sizes and modification times stay (a start asks for it twice: the held
    weights' cache and the KV cache on disk)."""
    stats = [(f, f.stat()) for f in model_files(Path(path))]
    return _fingerprint(tuple((f, st.st_size, st.st_mtime_ns) for f, st in stats))


@functools.lru_cache(maxsize=16)
def _fingerprint(files: tuple[tuple[Path, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for file, size, _ in files:
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            digest.update(f.read(PIECE))
            for i in range(1, PIECES + 1):
                f.seek(max(0, size * i // (PIECES + 1) - PIECE // 2))
                digest.update(f.read(PIECE))
    return digest.hexdigest()
