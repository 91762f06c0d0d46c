"""The prefix cache's files (disk_cache.py): one segment of a prompt's blocks each.

    MAGIC, u32 header length, header (JSON: version, model, parent, first, blocks,
    block_size, tensors [[dtype, shape without the block axis]...], crc32), then the payload:
    the segment's tokens (int32), then each cache tensor's blocks (K, V, and the scales of
    an 8-bit cache, layer by layer; the blocks along the second axis)

A block's digest chains the digest of the block before with its tokens (blake2b, stable
across processes, unlike the pool's keys), so one digest names a whole prefix; a segment
names its parent (the digest of the block before its first).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"LUCEDESK-KV\x00"
VERSION = 1
SUFFIX = ".kv"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8)
}


class SegmentError(Exception):
    """A file that is not a usable segment; the message says why."""


def chain(previous: bytes | None, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The digests of the full blocks of `tokens` after the prefix `previous` names."""
    digests, last = [], previous or b""
    for i in range(len(tokens) // block_size):
        piece = struct.pack(f"<{block_size}i", *tokens[i * block_size : (i + 1) * block_size])
        last = hashlib.blake2b(last + piece, digest_size=16).digest()
        digests.append(last)
    return digests


def block_digests(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The digest of every full block of `tokens` that does not hold its last token (the
    blocks a prefix cache may hold: the last token is computed for its logits)."""
    return chain(None, tokens[: (len(tokens) - 1) // block_size * block_size], block_size)


@dataclass(slots=True)
class Segment:
    path: Path
    parent: bytes | None
    first: int
    digests: list[bytes]
    size: int
    header_bytes: int = 0  # where the payload starts
    crc: int = 0


class SegmentFormat:
    """Segments of one model's blocks: its key, block size and cache tensors' layout."""

    def __init__(self, key: str, layout: list[tuple[torch.dtype, tuple[int, ...]]], bs: int):
        self.key = key
        self.layout = [[str(d).removeprefix("torch."), list(shape)] for d, shape in layout]
        self.block_size = bs

    def payload_bytes(self, num_blocks: int) -> int:
        total = num_blocks * self.block_size * 4
        for dtype, shape in self.layout:
            total += num_blocks * _count(shape) * _DTYPES[dtype].itemsize
        return total

    def read_header(self, path: Path) -> Segment:
        try:
            with path.open("rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise SegmentError("it is not a lucedesk KV file")
                (length,) = struct.unpack("<I", f.read(4))
                header = json.loads(f.read(length))
                size = os.fstat(f.fileno()).st_size
                if header.get("version") != VERSION or header.get("model") != self.key:
                    raise SegmentError("it is for another model or format")
                if header["block_size"] != self.block_size or header["tensors"] != self.layout:
                    raise SegmentError("its blocks have another layout")
                n, bs = header["blocks"], self.block_size
                start = len(MAGIC) + 4 + length
                if size != start + self.payload_bytes(n):
                    raise SegmentError(f"it is {size} bytes, not what its header says")
                tokens = struct.unpack(f"<{n * bs}i", f.read(n * bs * 4))
                parent = bytes.fromhex(header["parent"]) if header["parent"] else None
                first, crc = int(header["first"]), int(header["crc32"])
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise SegmentError(f"its header cannot be read ({exc})") from None
        return Segment(path, parent, first, chain(parent, tokens, bs), size, start, crc)

    def views(self, segment: Segment) -> list[torch.Tensor]:
        """The segment's blocks, one tensor per cache tensor: views of the file mapped
        (copy on write), checked against its checksum; no torch op runs here."""
        try:
            with segment.path.open("rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise SegmentError(f"it cannot be read ({exc})") from None
        payload = memoryview(data)[segment.header_bytes :]
        if len(data) != segment.size or zlib.crc32(payload) != segment.crc:
            raise SegmentError("its blocks do not match their checksum")
        n = len(segment.digests)
        offset = n * self.block_size * 4
        tensors = []
        for dtype, shape in self.layout:
            kind, count = _DTYPES[dtype], n * _count(shape)
            flat = torch.frombuffer(payload, dtype=kind, count=count, offset=offset)
            tensors.append(flat.view(shape[0], n, *shape[1:]))
            offset += count * kind.itemsize
        return tensors

    def write(
        self,
        folder: Path,
        parent: bytes | None,
        first: int,
        digests: list[bytes],
        tokens: list[int],
        tensors: list[torch.Tensor],
    ) -> Path:
        """A new segment file, written under a temporary name and renamed (a crash leaves
        no half-written segment)."""
        pieces = [struct.pack(f"<{len(tokens)}i", *tokens)]
        pieces += [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]
        crc = 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
        header = {
            "version": VERSION,
            "model": self.key,
            "parent": parent.hex() if parent else None,
            "first": first,
            "blocks": len(digests),
            "block_size": self.block_size,
            "tensors": self.layout,
            "crc32": crc,
        }
        head = json.dumps(header).encode()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{digests[-1].hex()}{SUFFIX}"
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with temporary.open("wb") as f:
                f.write(MAGIC + struct.pack("<I", len(head)) + head)
                for piece in pieces:
                    f.write(piece)
            os.replace(temporary, path)
        except BaseException:  # a full disk: no partial file stays behind
            temporary.unlink(missing_ok=True)
            raise
        return path


def _count(shape: list[int]) -> int:
    count = 1
    for s in shape:
        count *= s
    return count
