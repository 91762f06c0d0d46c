"""What attention needs to know about one step's ragged batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Rows of the step are grouped into sequences: the first `num_decodes` sequences are
    decodes, the rest prompt chunks. A decode has one query row, or 1 + k when it carries a
    k-token draft; the decode kernels read its KV blocks once for all of its rows. Row j of
    a sequence with n rows sits at position seq_len - n + j and sees keys up to there (its
    causal end), in a decode as in a chunk:

        query rows:   | d0 | d1 d1 d1 | d2 | p0 p0 p0 p0 | p1 p1 |
        query_start:  0    1          4    5             9       11
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache row each new K/V is written to
    query_start: torch.Tensor  # [num_seqs + 1] int32: first row of each sequence
    seq_lens: torch.Tensor  # [num_seqs] int32: cached tokens after this step (incl. new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so the torch path can loop over prompt chunks without device syncs.
    query_start_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_cpu[-1]

    @property
    def num_decode_tokens(self) -> int:
        """Query rows of the decode sequences (they come first)."""
        return self.query_start_cpu[self.num_decodes]

    def row_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For each query row: its sequence index and its position in that sequence (int32,
        on the metadata's device)."""
        device = self.seq_lens.device
        starts = self.query_start_cpu
        query_lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])], device=device)
        seq = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), query_lens)
        offset = torch.arange(self.num_tokens, device=device) - self.query_start.long()[seq]
        pos = (self.seq_lens.to(torch.int64) - query_lens)[seq] + offset
        return seq.to(torch.int32), pos.to(torch.int32)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_decodes: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """From per-sequence lists (decode sequences first)."""
        starts = [0]
        slots: list[int] = []
        for qlen, slen, table in zip(query_lens, seq_lens, block_tables):
            starts.append(starts[-1] + qlen)
            for pos in range(slen - qlen, slen):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            slot_mapping=tensor(slots, torch.int64),
            query_start=tensor(starts, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(padded, torch.int32) if padded else tensor([[0]], torch.int32),
            num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_cpu=starts,
            seq_lens_cpu=list(seq_lens),
        )
