"""Output processing: each request's new output tokens into the RequestOutput deltas its
handle streams. Text is detokenized incrementally; a stop string is never sent (a tail that
could still grow into one is held back until the next token says); logprobs travel with
their tokens; the last delta carries the finish reason.

Plain Python over Request objects: no model, no thread, so tests drive it with token
lists. The engine thread owns one and feeds it what Scheduler.update produced."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from lucedesk.engine.handle import RequestHandle, RequestOutput, TokenLogprob
from lucedesk.engine.models.tokenizer import IncrementalDetokenizer, Tokenizer
from lucedesk.engine.request import FinishReason, Request

log = logging.getLogger(__name__)

# Ends a request in the scheduler (Scheduler.finish): its blocks are freed and its id is
# among the recently finished, whose last delta the engine sends with close().
Finish = Callable[[Request, FinishReason, str | None], None]


@dataclass(slots=True)
class _Stream:
    """One open request's output state."""

    request: Request
    handle: RequestHandle
    detokenizer: IncrementalDetokenizer
    text: str = ""  # all output text so far, stop strings included
    num_emitted: int = 0  # characters of `text` already sent
    num_tokens_sent: int = 0
    num_pushed: int = 0  # output tokens given to the detokenizer
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    stop_sequence: str | None = None  # the stop string that ended it


class OutputProcessor:
    """The open requests' output streams, by request id."""

    def __init__(self, tokenizer: Tokenizer, finish: Finish) -> None:
        self.tokenizer = tokenizer
        self._finish = finish
        self._streams: dict[str, _Stream] = {}

    def add(self, req: Request, handle: RequestHandle) -> None:
        self._streams[req.request_id] = _Stream(
            req, handle, self.tokenizer.detokenizer(req.prompt_ids)
        )

    def get(self, request_id: str) -> Request | None:
        """The open request with this id, if any."""
        s = self._streams.get(request_id)
        return None if s is None else s.request

    def process(
        self, produced: list[Request], logprobs: dict[str, TokenLogprob] | None = None
    ) -> list[Request]:
        """Stream one step's new tokens. `produced` names a request once per token it made,
        in order (Scheduler.update); `logprobs` holds the step's logprob by request id.
        Returns the requests whose tokens counted, once per token: a stop string drops the
        tokens drafted after it. A failure here finishes only that request, with an error."""
        logprobs = logprobs or {}
        counted = []
        for req in produced:
            s = self._streams.get(req.request_id)
            if s is None or s.num_pushed >= req.num_output_tokens:
                continue  # dropped: it came after a stop string in the same step
            counted.append(req)
            try:
                self._push(s, logprobs.get(req.request_id))
            except Exception as exc:  # detokenizing one request must not stop the others
                log.exception("output processing failed for %s", req.request_id)
                self._finish(req, FinishReason.ERROR, f"output processing failed: {exc}")
        return counted

    def close(self, request_id: str) -> Request | None:
        """Send a finished request's last delta and forget it; returns the request (None
        when it is not open)."""
        s = self._streams.pop(request_id, None)
        if s is None:
            return None
        self._send(s, len(s.text), final=True)
        return s.request

    def _push(self, s: _Stream, logprob: TokenLogprob | None) -> None:
        """Detokenize the request's next output token and send what is safe to send. A draft
        row gives several tokens in one step: each comes here in turn, the last one `last`."""
        req = s.request
        token = req.output_ids[s.num_pushed]
        s.num_pushed += 1
        last = s.num_pushed == req.num_output_tokens
        if logprob is not None:
            s.logprobs.append(logprob)
        if token not in req.stop_ids:  # end tokens are counted, never shown
            s.text += s.detokenizer.push([token])
        stops = req.params.stop
        if stops and not (req.finished and last):
            # Look for a stop string in the newly decoded tail; never send one to the client.
            window = max(map(len, stops)) + 8
            tail_from = max(0, s.num_emitted - window)
            hits = [(i, st) for st in stops if (i := s.text.find(st, tail_from)) >= 0]
            if hits:
                at, s.stop_sequence = min(hits)
                s.text = s.text[:at]
                del req.output_ids[s.num_pushed :]  # drafted tokens after it are not output
                last = True
                if req.finished:  # at a later token of this step, which the stop cuts off
                    req.finish_reason = FinishReason.STOP
                else:
                    self._finish(req, FinishReason.STOP, None)
        if req.finished and last:
            s.text += s.detokenizer.flush() if req.finish_reason is not FinishReason.STOP else ""
            return  # sent by close()
        # Hold back a tail that could still grow into a stop string.
        held = max((overlap_with_start(s.text, st) for st in stops), default=0)
        self._send(s, len(s.text) - held)

    def _send(self, s: _Stream, upto: int, final: bool = False) -> None:
        req = s.request
        # Only tokens already pushed: a draft row's later tokens of this step may still be
        # cut off by a stop string.
        num_tokens = req.num_output_tokens if final else s.num_pushed
        text = s.text[s.num_emitted : upto]
        tokens = tuple(req.output_ids[s.num_tokens_sent : num_tokens])
        logprobs = tuple(s.logprobs[s.num_tokens_sent : num_tokens])
        if not text and not tokens and not final:
            return
        s.num_emitted = max(s.num_emitted, upto)
        s.num_tokens_sent = num_tokens
        s.handle.push(
            RequestOutput(
                request_id=req.request_id,
                text=text,
                token_ids=tokens,
                finished=final,
                finish_reason=req.finish_reason if final else None,
                error=req.error if final else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_cached_tokens=req.num_cached_tokens or 0,
                logprobs=logprobs,
                stop_sequence=s.stop_sequence if final else None,
            )
        )


def overlap_with_start(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (a tail to
    hold back: it may grow into the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
