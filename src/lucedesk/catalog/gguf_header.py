"""A GGUF file's header: its metadata and its tensor table, read without torch from a memory
map, a file's first bytes or bytes fetched from a hub. The engine maps the tensors' data
(engine/models/gguf_file.py); the catalog reads headers to list and size models.

    magic "GGUF" | version u32 | tensor count u64 | key count u64
    keys:    name (u64 length + utf-8) | value type u32 | value
    tensors: name | dims u32 + u64 each | type u32 | offset u64 (from the data start)
    padding to general.alignment | tensor data

A model split by llama.cpp's gguf-split is several such files (`NAME-00001-of-00003.gguf`,
numbered from 1): the first holds every key, each holds its own tensors, and all carry
`split.no` (from 0), `split.count` and `split.tensors.count` (the model's whole count).
"""

from __future__ import annotations

import functools
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lucedesk.errors import ModelLoadError

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9

# `NAME-00001-of-00003.gguf`: one part of a split model.
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class Truncated(ModelLoadError):
    """The bytes end inside the header: a partial read needs more of the file."""


@dataclass(slots=True, frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # PyTorch order: [rows, cols]
    type_name: str  # GGML's name: Q4_K, F16, MXFP4...
    type_id: int
    offset: int  # from the start of the file's data section
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class Header:
    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    data_start: int  # where the tensor data begins in the file

    @property
    def split_count(self) -> int:
        return int(self.metadata.get("split.count", 1) or 1)

    @property
    def split_no(self) -> int:
        return int(self.metadata.get("split.no", 0) or 0)


_LENGTH = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reads over bytes; a read past the end raises Truncated."""

    def __init__(self, buf, source: str) -> None:
        self.buf, self.pos, self.source = buf, 0, source

    def _need(self, size: int) -> None:
        if self.pos + size > len(self.buf):
            raise Truncated(f"{self.source}: truncated GGUF header")

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges): `string`'s reads in one
        loop, a fifth of the time for a 150k-token vocabulary."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = _LENGTH.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise Truncated(f"{self.source}: truncated GGUF header")
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise Truncated(f"{self.source}: truncated GGUF header")
            out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.take("<I"), self.take("<Q")
            if elem in _SCALARS:  # numeric arrays in one go
                dtype = np.dtype(_SCALARS[elem])
                self._need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            if elem == _STRING:
                return self.strings(count)
            return [self.value(elem) for _ in range(count)]
        raise ModelLoadError(f"{self.source}: unknown GGUF value type {kind}")


def parse_header(buf, source: str, file_size: int | None = None) -> Header:
    """The header in `buf` (bytes, or a memory map of the whole file). `file_size`, where
    `buf` is only the file's beginning, is what tensor extents are checked against.
    Raises Truncated where `buf` ends inside the header, ModelLoadError where it is not
    a GGUF header or a tensor reaches past the file's end."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = len(buf) if file_size is None else file_size
    if bytes(buf[:4]) != b"GGUF":
        raise ModelLoadError(f"{source}: not a GGUF file (bad magic)")
    cur = _Cursor(buf, source)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{source}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_kv = cur.take("<Q"), cur.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    raw = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        raw.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, type_id, offset in raw:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has unknown type id {type_id}"
            ) from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(dims) // block * type_size
        if data_start + offset + nbytes > size:
            raise ModelLoadError(
                f"{source}: truncated: tensor {name!r} needs bytes up to "
                f"{data_start + offset + nbytes}, the file has {size}"
            )
        shape = tuple(int(d) for d in reversed(dims))
        tensors.append(TensorEntry(name, shape, qtype.name, type_id, offset, nbytes))
    return Header(metadata, tensors, data_start)


def read_header(path: Path, first_bytes: int = 8 << 20) -> Header:
    """A file's header, reading its first bytes (more where the header is longer); read
    once per process while the file's size and modification time stay (a start reads it
    twice: the fit check, then the loader). Not to be changed: it is shared."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc})") from None
    return _read_header(path, stat.st_size, stat.st_mtime_ns, first_bytes)


@functools.lru_cache(maxsize=4)
def _read_header(path: Path, size: int, mtime_ns: int, first_bytes: int) -> Header:
    try:
        with open(path, "rb") as f:
            while True:
                f.seek(0)
                buf = f.read(min(first_bytes, size))
                try:
                    return parse_header(buf, str(path), size)
                except Truncated:
                    if len(buf) >= size:
                        raise
                    first_bytes *= 4
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc})") from None


def split_parts(first: Path, count: int) -> list[Path]:
    """The files of a split model named like `first` (its part 1), in order."""
    match = SPLIT_NAME.match(first.name)
    if match is None:
        raise ModelLoadError(
            f"{first}: holds part 1 of {count} of a split model, but its name does not end in "
            f"-00001-of-{count:05d}.gguf, so its other parts cannot be found"
        )
    prefix = match["prefix"]
    return [first.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
