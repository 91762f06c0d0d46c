"""How many prompt tokens a step may add beside its decode rows (no torch, no I/O).

A prompt chunk that runs in the same step as decode rows makes every one of those streams
wait for it: a 256-token chunk on a CPU turns an 11 ms token into a 120 ms one. The pacer
learns from the steps the engine times what a step costs and sizes the chunk so that such
a step takes at most `slowdown` times what the same decode rows take alone, or `floor`
seconds where that is more:

    alone[d]   the time of a decode-only step with d decode tokens (d's power-of-two bucket)
    per_token  the time one prompt token adds beside decodes (it grows with the prompt's
               position: attention reads every earlier token)
    target     max(slowdown * alone[d], floor)
    chunk      (target - alone[d]) / per_token, between `least` and `most`

The floor is for devices whose decode steps are so cheap next to a prompt token that twice
one buys almost no prompt: a CPU decodes the default model's token in ~3 ms and computes a
prompt token late in a 6,000-token prompt in ~1 ms, so a 2x bound alone would prefill a
handful of tokens a step and take several times as long to reach the prompt's first token.

Both are exponentially weighted averages of the latest steps, so the chunk follows a prompt
whose tokens cost more as it grows and a machine whose load changes. Before a decode-only
step of a size has been timed, the nearest smaller size's time stands in; before any step
has been timed, that step runs no prompt tokens (it is the one timed); before a step with
prompt tokens has been timed, the chunk is `least`.
"""

from __future__ import annotations

WEIGHT = 0.25  # of the newest step in each average


def bucket(num_decode_tokens: int) -> int:
    """Decode-only steps of 1, 2-3, 4-7, 8-15... tokens are timed together."""
    return num_decode_tokens.bit_length()


class StepPacer:
    def __init__(self, slowdown: float, least: int, most: int, floor: float = 0.0) -> None:
        if slowdown <= 1.0 or least < 1 or most < least or floor < 0:
            raise ValueError("a pacer needs slowdown > 1, floor >= 0 and 1 <= least <= most")
        self.slowdown = slowdown
        self.floor = floor
        self.least = least
        self.most = most
        self._alone: dict[int, float] = {}  # bucket -> seconds of a decode-only step
        self.per_token: float | None = None  # seconds one prompt token adds beside decodes

    def alone(self, num_decode_tokens: int) -> float | None:
        """The expected time of a decode-only step of this many tokens (None: not known)."""
        b = bucket(num_decode_tokens)
        known = [k for k in self._alone if k <= b]
        return self._alone[max(known)] if known else None

    def chunk(self, num_decode_tokens: int) -> int:
        """The most prompt tokens to run beside `num_decode_tokens` decode tokens."""
        alone = self.alone(num_decode_tokens)
        if alone is None:
            return 0  # a decode-only step first: what the others are measured against
        if self.per_token is None:
            return self.least
        if self.per_token <= 1e-9:  # a prompt token adds no time that can be measured
            return self.most
        target = max(self.slowdown * alone, self.floor)
        room = (target - alone) / self.per_token + 1e-9  # not 19.999...
        return max(self.least, min(self.most, int(room)))

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """A step of this many decode and prompt tokens took `seconds`."""
        if num_decode_tokens == 0:
            return  # prompt-only steps run at the idle chunk: nobody waits on them
        b = bucket(num_decode_tokens)
        if num_prompt_tokens == 0:
            old = self._alone.get(b)
            self._alone[b] = seconds if old is None else old + WEIGHT * (seconds - old)
            return
        alone = self.alone(num_decode_tokens)
        if alone is None:
            return
        cost = max(seconds - alone, 0.0) / num_prompt_tokens
        old = self.per_token
        self.per_token = cost if old is None else old + WEIGHT * (cost - old)
