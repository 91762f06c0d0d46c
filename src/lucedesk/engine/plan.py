"""A step's plan: the rows the scheduler hands the runner, and the blocks it loads first
(no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from lucedesk.engine.request import Request


class ScheduledRow(NamedTuple):
    """`num_tokens` tokens of `request` starting at position `start`; `sample` when this
    chunk reaches the request's last token, so a new token is sampled from its last row.
    A decode row with a `draft` runs its next input and then the draft's tokens, each
    position as a decode of its own: logits on every one, the longest agreeing prefix
    kept."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    draft: tuple[int, ...] = ()


class BlockLoad(NamedTuple):
    """Blocks a request adopts from a prefix read from disk (disk_cache.LoadedPrefix): its
    blocks from `start` on go into `block_ids` before the step runs."""

    block_ids: list[int]
    prefix: object
    start: int


@dataclass(slots=True)
class StepPlan:
    step: int
    decodes: list[ScheduledRow] = field(default_factory=list)
    prefills: list[ScheduledRow] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    # Requests that left the engine since the last plan (their per-request state is dropped).
    finished_ids: list[str] = field(default_factory=list)

    @property
    def rows(self) -> list[ScheduledRow]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)
