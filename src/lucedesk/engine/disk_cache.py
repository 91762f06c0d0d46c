"""The prefix cache on disk: the K/V of long prompts' full blocks, kept across restarts.

An agent's system prompt and tool descriptions (20,000 tokens for some clients) are the same
at every start; the pool's prefix cache (kv_cache.py) forgets them when the process ends.
Here, once a prompt of at least `min_tokens` has been computed, the blocks of it that the
disk does not hold yet are written as one segment file (kv_segments.py); a later prompt with
that prefix, in this process or the next, reads them back into the pool instead of
computing them.

    <root>/<model key>/<digest of the segment's last block>.kv

The model key is a hash of the model's files (catalog/fingerprint.py), its dtype, the KV
dtype, the weight format, the kernels and the block size: the K/V a block holds depends on
all of them. A segment names its parent, so an agent session that grows by a turn writes
only its new blocks.

A file whose header, size, checksum or layout does not match is ignored (and removed) with a
log line. The whole cache (every model's folder under the root) is kept under `limit_bytes`:
the least recently used segments go first (a hit refreshes the segments it read).

Reads and writes run on two threads of their own: the engine thread only checks the index
(a dict), copies the blocks of a computed prompt out of the pool, and copies loaded blocks
into it (engine_loop.py, scheduler.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lucedesk.engine.kv_segments import (
    SUFFIX,
    VERSION,
    Segment,
    SegmentError,
    SegmentFormat,
    block_digests,
)

log = logging.getLogger(__name__)

MIN_BLOCKS = 4  # a segment shorter than this is not worth a file, nor a load
QUEUE_BYTES = 1 << 30  # copies of blocks waiting for the disk, at most


def disk_cache_root() -> Path:
    """LUCEDESK_KV_CACHE, else the folder kv in lucedesk's cache folder."""
    from platformdirs import user_cache_dir

    if os.environ.get("LUCEDESK_KV_CACHE"):
        return Path(os.environ["LUCEDESK_KV_CACHE"]).expanduser()
    return Path(user_cache_dir("lucedesk")) / "kv"


def model_key(fingerprint: str, *parts: object) -> str:
    """The name of a model's folder: its files' fingerprint and what else shapes its K/V."""
    text = "|".join([fingerprint, *map(str, parts), f"v{VERSION}"])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(slots=True)
class LoadedPrefix:
    """Blocks `first` .. `end - 1` of a prompt, read from disk: per segment read, one tensor
    per cache tensor, the blocks along the second axis (TorchSeqEngine.write_blocks takes
    them). They are views of the bytes read: no torch op runs on the reading thread (a
    second thread's OpenMP team makes both slower by several times)."""

    first: int
    parts: list[list[torch.Tensor]]

    @property
    def end(self) -> int:
        return self.first + sum(p[0].shape[1] for p in self.parts)

    def pieces(self, start: int, count: int) -> list[tuple[int, list[torch.Tensor]]]:
        """Blocks first + start .. + count - 1 as (their offset from `start`, tensors)."""
        out, at = [], 0
        for part in self.parts:
            n = part[0].shape[1]
            lo, hi = max(start - at, 0), min(start + count - at, n)
            if lo < hi:
                out.append((at + lo - start, [t[:, lo:hi] for t in part]))
            at += n
        return out


@dataclass(slots=True)
class _Save:
    parent: bytes | None
    first: int
    digests: list[bytes]
    tokens: list[int]
    tensors: list[torch.Tensor]


class DiskPrefixCache:
    def __init__(
        self,
        root: Path,
        key: str,
        layout: list[tuple[torch.dtype, tuple[int, ...]]],
        block_size: int,
        limit_bytes: int,
        min_tokens: int,
    ) -> None:
        self.root = root
        self.folder = root / key
        self.key = key
        self.format = SegmentFormat(key, layout, block_size)
        self.block_size = block_size
        self.limit_bytes = limit_bytes
        self.min_tokens = max(min_tokens, block_size * MIN_BLOCKS + 1)
        self._index: dict[bytes, tuple[Segment, int]] = {}
        self._pending: set[bytes] = set()  # digests queued for writing
        self._queued_bytes = 0  # ...and the bytes of their copies
        self._lock = threading.Lock()
        self._ready = threading.Event()  # the folder has been read
        self._loads: queue.Queue = queue.Queue()
        self._saves: queue.Queue = queue.Queue()
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self._threads = [
            threading.Thread(target=self._load_loop, name="lucedesk-kv-read", daemon=True),
            threading.Thread(target=self._save_loop, name="lucedesk-kv-write", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the engine thread --------------------------------------------------------------------

    def digests(self, tokens: Sequence[int]) -> list[bytes]:
        return block_digests(tokens, self.block_size)

    @property
    def ready(self) -> bool:
        """Whether the folder has been read (until then nothing is found, nor written)."""
        return self._ready.is_set()

    def known(self, digests: Sequence[bytes], pending: bool = False) -> int:
        """How many of these leading blocks the disk holds (with `pending`: or will, once
        the writes queued are done). 0 while the folder is still being read."""
        if not self._ready.is_set():
            return 0
        n = 0
        for d in digests:
            if d not in self._index and not (pending and d in self._pending):
                break
            n += 1
        return n

    def load(
        self,
        digests: Sequence[bytes],
        first: int,
        done: Callable[[LoadedPrefix | None], None],
    ) -> None:
        """Read blocks `first` on of the prefix of `digests` the disk holds, on the
        reading thread (once the folder has been read), then call `done` there with them
        (None where it holds fewer than MIN_BLOCKS of them, or they could not be read)."""
        self._loads.put((list(digests), first, done))

    def save(
        self, digests: Sequence[bytes], first: int, tokens: list[int], tensors: list[torch.Tensor]
    ) -> None:
        """Write blocks first .. first + len(digests) - 1 of a prompt (their tokens and a
        copy of their K/V, read_blocks) as a segment, on the writing thread."""
        parent = digests[first - 1] if first else None
        job = _Save(parent, first, list(digests[first:]), tokens, tensors)
        with self._lock:
            self._pending.update(job.digests)
            self._queued_bytes += self.format.payload_bytes(len(job.digests))
        self._saves.put(job)

    def has_room(self, num_blocks: int) -> bool:
        """Whether a copy of this many blocks may join the writes queued: at most
        QUEUE_BYTES of copies wait for the disk (prompts beyond that are not written)."""
        return self._queued_bytes + self.format.payload_bytes(num_blocks) <= QUEUE_BYTES

    def flush(self, timeout: float = 30.0) -> bool:
        """Whether the folder was read and every write queued so far finished within
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        if not self._ready.wait(timeout):
            return False
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending and self._saves.empty():
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Finish the writes queued (up to `timeout` seconds) and stop both threads."""
        self._loads.put(None)
        self._saves.put(None)
        for thread in self._threads:
            thread.join(timeout)

    # -- the reading thread -------------------------------------------------------------------

    def _load_loop(self) -> None:
        try:
            self._scan()
        except Exception:  # what was indexed stays; the thread must go on answering
            log.exception("prefix cache: reading %s failed", self.folder)
        finally:
            self._ready.set()
        while (job := self._loads.get()) is not None:
            digests, first, done = job
            try:
                prefix = self._read(digests[: self.known(digests)], first)
            except Exception:  # a bug here must not lose the request: it runs uncached
                log.exception("prefix cache: reading %d blocks failed", len(digests) - first)
                prefix = None
            done(prefix)

    def _scan(self) -> None:
        """Index the segments of this model's folder (a segment whose parent is missing
        is indexed too: its blocks are found only through a prefix that is there)."""
        if not self.folder.is_dir():
            return
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            segment = self._segment(path)
            if segment is not None:
                self._add(segment)
        for stale in self.folder.glob(f".*{SUFFIX}.*.tmp"):  # left by a crash mid-write
            with contextlib.suppress(OSError):  # (or being written by another process)
                if time.time() - stale.stat().st_mtime > 600:
                    stale.unlink()

    def _segment(self, path: Path) -> Segment | None:
        try:
            return self.format.read_header(path)
        except SegmentError as exc:
            return self._reject(path, str(exc))

    def _reject(self, path: Path, why: str) -> None:
        log.warning("prefix cache: %s ignored and removed: %s", path, why)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return None

    def _add(self, segment: Segment) -> None:
        with self._lock:
            for i, d in enumerate(segment.digests):
                self._index.setdefault(d, (segment, i))

    def _drop(self, segment: Segment) -> None:
        with self._lock:
            for d in segment.digests:
                if self._index.get(d, (None,))[0] is segment:
                    del self._index[d]

    def _read(self, digests: list[bytes], first: int) -> LoadedPrefix | None:
        """Blocks first.. of the chain, from the segments that hold them, in order."""
        parts: list[list[torch.Tensor]] = []
        i = first
        while i < len(digests):
            found = self._index.get(digests[i])
            if found is None:
                break
            segment, j = found
            # The segment holds blocks segment.first .. ; take what is asked of it.
            take = min(len(segment.digests) - j, len(digests) - i)
            if segment.digests[j : j + take] != list(digests[i : i + take]):
                break
            tensors = self._read_segment(segment)
            if tensors is None:
                break
            parts.append([t[:, j : j + take] for t in tensors])
            with contextlib.suppress(OSError):
                os.utime(segment.path)  # used: the last to be evicted
            self._touch_ancestors(segment)
            i += take
        if i - first < MIN_BLOCKS:
            return None
        self.num_loaded_blocks += i - first
        return LoadedPrefix(first, parts)

    def _read_segment(self, segment: Segment) -> list[torch.Tensor] | None:
        try:
            return self.format.views(segment)
        except SegmentError as exc:
            self._drop(segment)
            self._reject(segment.path, str(exc))
            return None

    # -- the writing thread -------------------------------------------------------------------

    def _save_loop(self) -> None:
        self._ready.wait()
        while (job := self._saves.get()) is not None:
            try:
                self._write(job)
            except OSError as exc:  # a full or read-only disk: the engine goes on without
                log.warning("prefix cache: %d blocks not written: %s", len(job.digests), exc)
            except Exception:
                log.exception("prefix cache: writing %d blocks failed", len(job.digests))
            finally:
                with self._lock:
                    self._pending.difference_update(job.digests)
                    self._queued_bytes -= self.format.payload_bytes(len(job.digests))

    def _write(self, job: _Save) -> None:
        path = self.format.write(
            self.folder, job.parent, job.first, job.digests, job.tokens, job.tensors
        )
        self._forget_path(path)  # a segment of that name it replaced (its parent evicted)
        segment = self._segment(path)
        if segment is None:
            return
        self._add(segment)
        self.num_saved_blocks += len(job.digests)
        self._touch_ancestors(segment)
        self._evict(keep=path)

    def _forget_path(self, path: Path) -> None:
        with self._lock:
            segments = {id(s): s for s, _ in self._index.values() if s.path == path}
        for segment in segments.values():
            self._drop(segment)

    def _touch_ancestors(self, segment: Segment) -> None:
        """A segment's parents were used as recently as it: the least recently used go
        first, and a parent gone strands its children."""
        parent = segment.parent
        while parent is not None and (found := self._index.get(parent)) is not None:
            with contextlib.suppress(OSError):
                os.utime(found[0].path)
            parent = found[0].parent

    def _evict(self, keep: Path) -> None:
        """Remove the least recently used segments of any model until the cache fits."""
        files = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.limit_bytes:
                break
            if path == keep:
                continue
            self._forget_path(path)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            total -= size
            log.info("prefix cache: %s evicted (%d MiB)", path.name, size >> 20)
