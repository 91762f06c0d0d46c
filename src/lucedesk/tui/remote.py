"""Sessions that talk to another OpenAI-compatible server (a bigger model on a vLLM or
llama.cpp server elsewhere) instead of the in-process engine. A RemoteHandle reads like an
engine RequestHandle, so a pane streams from either the same way."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator

import httpx

from lucedesk.engine import FinishReason, RequestOutput, SamplingParams


def api_base(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class RemoteHandle:
    def __init__(
        self,
        url: str,
        messages: list[dict],
        params: SamplingParams,
        owner: str,
        api_key: str | None = None,
    ) -> None:
        self.request_id = f"remote-{id(self):x}"
        self.url = api_base(url)
        self.body = {
            "messages": messages,
            "max_tokens": params.max_tokens,
            "stream": True,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream_options": {"include_usage": True},
        }
        self.headers = {"X-Lucedesk-Client": owner}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._events: deque[RequestOutput] = deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._final = False

    @property
    def finished(self) -> bool:
        return self._final

    def start(self) -> RemoteHandle:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _push(self, out: RequestOutput) -> None:
        self._events.append(out)
        self._ready.set()
        if out.finished:
            self._final = True

    async def _run(self) -> None:
        reason, error, tokens = FinishReason.STOP, None, 0
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as http:
                async with http.stream(
                    "POST", self.url + "/chat/completions", json=self.body, headers=self.headers
                ) as r:
                    if r.status_code != 200:
                        text = (await r.aread()).decode(errors="replace")
                        try:
                            text = json.loads(text)["error"]["message"]
                        except (ValueError, KeyError, TypeError):
                            text = text[:200]
                        raise RuntimeError(f"{self.url} answered {r.status_code}: {text}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens = event["usage"].get("completion_tokens", tokens)
                        for choice in event.get("choices") or []:
                            text = (choice.get("delta") or {}).get("content") or ""
                            if text:
                                self._push(RequestOutput(self.request_id, text, ()))
                            if choice.get("finish_reason") == "length":
                                reason = FinishReason.LENGTH
        except asyncio.CancelledError:
            reason = FinishReason.CANCELLED
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            reason, error = FinishReason.ERROR, str(exc) or type(exc).__name__
        self._push(
            RequestOutput(
                self.request_id,
                "",
                (),
                finished=True,
                finish_reason=reason,
                error=error,
                num_output_tokens=tokens,
            )
        )

    def take_ready(self) -> list[RequestOutput]:
        ready = list(self._events)
        self._events.clear()
        return ready

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        while True:
            while not self._events:
                self._ready.clear()
                await self._ready.wait()
            out = self._events.popleft()
            yield out
            if out.finished:
                return


async def remote_slots(url: str) -> str:
    """One line on what a remote server reports about its slots, if it reports anything."""
    base = url.rstrip("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            r = await http.get(base + "/slots")
            if r.status_code == 200:
                data = r.json()
                slots = data.get("slots", data if isinstance(data, list) else [])
                busy = sum(1 for s in slots if s.get("request_id") or s.get("is_processing"))
                return f"{base}: {busy}/{len(slots)} slots busy"
            r = await http.get(base + "/metrics")
            if r.status_code == 200:
                return f"{base}: /metrics available ({len(r.text.splitlines())} lines)"
    except (httpx.HTTPError, ValueError):
        return f"{base}: unreachable"
    return f"{base}: reports no slots"
