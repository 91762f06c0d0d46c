"""RequestHandle: a request's stream of outputs, readable from any thread or event loop."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from lucedesk.engine.request import FinishReason


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A sampled token's log probability under the model (before temperature and grammar
    masks) and the `top` most likely tokens with theirs, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True, frozen=True)
class RequestOutput:
    """One delta: the tokens and text a request produced in one step."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache already held
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of `token_ids`, where asked
    stop_sequence: str | None = None  # on the last output: the stop string that ended it


@dataclass(slots=True, frozen=True)
class Completion:
    """A whole finished request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob]


class RequestHandle:
    """Fed by the engine thread (`push`); read with `for out in handle`, `async for out in
    handle`, `handle.result()` or `await handle.aresult()`. Outputs are buffered here, so a
    slow reader never holds up the engine."""

    def __init__(
        self, request_id: str, num_prompt_tokens: int, cancel: Callable[[str], None]
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._cancel = cancel
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._events: deque[RequestOutput] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_ready: asyncio.Event | None = None
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._final: RequestOutput | None = None
        self._read_final = False

    # -- engine side ------------------------------------------------------------------------

    def push(self, output: RequestOutput) -> None:
        with self._lock:
            self._events.append(output)
            self._text.append(output.text)
            self._token_ids.extend(output.token_ids)
            self._logprobs.extend(output.logprobs)
            if output.finished:
                self._final = output
            self._ready.notify_all()
            loop, event = self._loop, self._async_ready
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the reader's loop is closed: nobody is listening
                pass

    # -- reader side ------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._final is not None

    def cancel(self) -> None:
        self._cancel(self.request_id)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            with self._lock:
                while not self._events:
                    if self._read_final:
                        return
                    self._ready.wait()
                out = self._events.popleft()
                self._read_final = out.finished
            yield out

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._async_ready = asyncio.Event()
        while True:
            with self._lock:
                if self._events:
                    out = self._events.popleft()
                    self._read_final = out.finished
                elif self._read_final:
                    return
                else:
                    out = None
                    self._async_ready.clear()
            if out is None:
                await self._async_ready.wait()
                continue
            yield out
            if out.finished:
                return

    def take_ready(self) -> list[RequestOutput]:
        """Every output already buffered, without waiting (readers that render, like the TUI,
        handle a burst in one go)."""
        with self._lock:
            ready = list(self._events)
            self._events.clear()
            if ready and ready[-1].finished:
                self._read_final = True
            return ready

    def result(self, timeout: float | None = None) -> Completion:
        with self._lock:
            if not self._ready.wait_for(lambda: self._final is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout}s")
            return self._completion()

    async def aresult(self) -> Completion:
        async for _ in self:
            pass
        with self._lock:
            return self._completion()

    def _completion(self) -> Completion:
        final = self._final
        assert final is not None and final.finish_reason is not None
        return Completion(
            request_id=self.request_id,
            text="".join(self._text),
            token_ids=list(self._token_ids),
            finish_reason=final.finish_reason,
            error=final.error,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=final.num_output_tokens,
            logprobs=list(self._logprobs),
        )
