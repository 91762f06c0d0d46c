"""The boundary between policy and tensors: the scheduler hands a `StepPlan` to a SeqEngine,
which runs it and answers with a `StepResult`."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from lucedesk.engine.handle import TokenLogprob
from lucedesk.engine.plan import StepPlan


class StepResult(NamedTuple):
    sampled: dict[int, int]  # slot -> new token, for every row of the plan that samples
    errors: dict[int, str]  # slot -> message, for rows that failed on their own
    # slot -> the new token's logprobs, where asked (never mutated, so one shared default)
    logprobs: dict[int, TokenLogprob] = {}
    stopped: frozenset[int] = frozenset()  # slots whose grammar is complete with this token
    # slot -> the draft tokens the model agreed with, which come before its `sampled` token
    accepted: dict[int, tuple[int, ...]] = {}


class SeqEngine(Protocol):
    """Runs plans for one model. Implementations own the KV tensors and the sampler."""

    num_blocks: int
    vocab_size: int  # the width of the logits (grammar masks are this wide)

    def forget(self, request_ids: list[str]) -> None:
        """Drop any per-request state (sampler generators) of requests that left."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Compute every row of `plan` in one forward and sample where the plan asks.

        Raises only when the step as a whole failed; the caller then isolates the culprit."""
        ...
