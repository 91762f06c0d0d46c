"""Bookkeeping of the paged KV cache: which blocks are free, who holds each, and which full
blocks hold a known run of tokens that a later request can reuse (no torch).

The KV tensors live in the runner; a block id here is an index into their block axis.

Prefix caching: a full block's key chains the previous block's key with its own tokens,

    key(block i) = hash((key(block i-1), tokens[i*bs : (i+1)*bs]))

so equal keys mean equal prefixes; a hit is still confirmed by comparing the tokens. When
its last holder lets go, a keyed block keeps its key and waits on an LRU list: a new request
with the same prefix takes it back (a hit), and the pool hands it out for other data only
after every never-keyed free block is gone (the least recently used first).

Blank blocks are handed out last freed first, and a block never used only when no freed one
is blank: the pool's pages are reserved, not written (kernels/kv_storage.zeros), so the
blocks ever used (`num_touched_blocks`) are what the pool holds resident, and with the
prefix cache off they stay the most that were ever in use at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


def chain_key(previous: int | None, tokens: Sequence[int]) -> int:
    return hash((previous, tuple(tokens)))


class BlockPool:
    """A fixed pool of `num_blocks` blocks of `block_size` tokens, with reference counts.

    Check/act pairs: `can_allocate(n)` then `allocate(n)`; `lookup(tokens)` then
    `adopt(blocks)`; `free(ids)` gives references back."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.ref_counts = [0] * num_blocks
        self._free: list[int] = []  # freed, holding nothing reusable; the last freed last
        self._fresh = 0  # blocks fresh..num_blocks - 1 were never handed out
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, keyed; LRU first
        self._key_of: dict[int, int] = {}  # block -> its key
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its tokens (to confirm)
        self._block_of: dict[int, int] = {}  # key -> block
        # Keys of full blocks a running prefill will compute: a request sharing that prefix
        # waits for them rather than computing the same tokens a second time.
        self._pending: dict[int, int] = {}  # key -> block
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blank_blocks + len(self._free_cached)

    @property
    def num_blank_blocks(self) -> int:
        """Free blocks holding no cached prefix (taking one evicts nothing)."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever handed out: those whose pages are resident."""
        return self._fresh

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        ids = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.pop()
            elif self._fresh < self.num_blocks:
                block = self._fresh
                self._fresh += 1
            else:  # evict the least recently used keyed block
                block, _ = self._free_cached.popitem(last=False)
                self._forget(block)
                self.num_evictions += 1
            self.ref_counts[block] = 1
            ids.append(block)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        # Freed in reverse so a sequence's tail blocks are reused first and its head blocks,
        # the likeliest to be shared, stay longest.
        for i in reversed(list(block_ids)):
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"block {i} freed more often than it was allocated")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                if i in self._key_of:
                    self._free_cached[i] = None
                else:
                    self._free.append(i)

    # -- prefix caching ---------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> tuple[list[int], bool]:
        """Cached blocks holding the longest run of full blocks at the start of `tokens`,
        never covering the last token (it must be computed to get logits); and whether the
        next block of that run is being computed right now by another request."""
        if not self.caching:
            return [], False
        bs = self.block_size
        hits: list[int] = []
        key = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = chain_key(key, chunk)
            block = self._block_of.get(key)
            if block is None or self._tokens_of[block] != chunk:
                return hits, key in self._pending
            hits.append(block)
        return hits, False

    def key_of(self, block: int) -> int:
        return self._key_of[block]

    def expect(self, blocks: Sequence[int], keys: Sequence[int]) -> None:
        """Mark blocks a request will fill with known tokens (see lookup)."""
        if self.caching:
            for block, key in zip(blocks, keys):
                self._pending.setdefault(key, block)

    def unexpect(self, blocks: Iterable[int]) -> None:
        if self._pending:
            gone = set(blocks)
            for key in [k for k, b in self._pending.items() if b in gone]:
                del self._pending[key]

    def num_free_among(self, blocks: Iterable[int]) -> int:
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def adopt(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks found by `lookup`."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free_cached[b]
            self.ref_counts[b] += 1

    def register(self, block: int, previous_key: int | None, tokens: Sequence[int]) -> int:
        """Record that `block` (held, full) holds `tokens` after the prefix `previous_key`;
        returns the block's key. A key already held by another block is left as it is."""
        chunk = tuple(tokens)
        key = chain_key(previous_key, chunk)
        if self._pending.get(key) == block:
            del self._pending[key]
        if self.caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key
            self._tokens_of[block] = chunk
        return key

    def forget_keys(self, blocks: Iterable[int]) -> None:
        """Blocks whose contents are not what their keys say (a load that failed): no later
        request may adopt them; free ones go back with the blank blocks."""
        for b in blocks:
            if b in self._key_of:
                self._forget(b)
            if b in self._free_cached:
                del self._free_cached[b]
                self._free.append(b)
        self.unexpect(blocks)

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._tokens_of[block]
        del self._block_of[key]

    def check_integrity(self, block_tables: Iterable[list[int]]) -> None:
        """Every block is either free (count 0, on one free list once) or held exactly as
        many times as the given block tables name it. Raises AssertionError otherwise."""
        held = [0] * self.num_blocks
        for table in block_tables:
            for i in table:
                held[i] += 1
        free = self._free + list(self._free_cached) + list(range(self._fresh, self.num_blocks))
        assert len(set(free)) == len(free), "a block is on a free list twice"
        for i in free:
            assert self.ref_counts[i] == 0, f"free block {i} has references"
        assert held == self.ref_counts, "reference counts differ from the block tables"
        assert sum(1 for c in self.ref_counts if c == 0) == len(free), "a block is lost"
        assert all(b in self._key_of for b in self._free_cached), "an unkeyed cached block"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "key map broken"
