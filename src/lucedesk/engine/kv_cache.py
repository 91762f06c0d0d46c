"""Bookkeeping of the paged KV cache: which blocks are free and who holds each (no torch).

The KV tensors live in the runner; a block id here is an index into their first axis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A fixed pool of `num_blocks` blocks of `block_size` tokens, with reference counts.

    Check/act pairs: `can_allocate(n)` then `allocate(n)`; `free(ids)` gives references back
    and returns a block to the free list when its count reaches zero."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(num_blocks)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        # Freed in reverse so a sequence's tail blocks are reused first and its head blocks
        # stay untouched longest.
        for i in reversed(list(block_ids)):
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"block {i} freed more often than it was allocated")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self._free.append(i)

    def check_integrity(self, block_tables: Iterable[list[int]]) -> None:
        """Every block is either free (count 0, on the free list once) or held exactly as many
        times as the given block tables name it. Raises AssertionError otherwise."""
        held = [0] * self.num_blocks
        for table in block_tables:
            for i in table:
                held[i] += 1
        free = list(self._free)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        for i in free:
            assert self.ref_counts[i] == 0, f"free block {i} has references"
        assert held == self.ref_counts, "reference counts differ from the block tables"
        assert sum(1 for c in self.ref_counts if c == 0) == len(free), "a block is lost"
