"""Where an agent's model turns run: the in-process engine, or any OpenAI-compatible server
(another lucedesk, vLLM, llama.cpp's server). Both take the engine's `TurnRequest`
and give back a `TurnResult`, the reply's text streamed to `on_text` and its reasoning to
`on_reasoning` as they come; an error is a result with finish "error", never an exception.
Cancelling the caller cancels the request.

Both also measure, for compaction and the context shown in a pane: the tokens one request
holds, a prompt's tokens and a text's. The engine counts with the model's own tokenizer and
template; a server is asked its context once (its model listing) and its tokens estimated
from characters, on the high side."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

import httpx

from lucedesk.chat import ToolCall, ToolChoice, TurnRequest, TurnResult, count_prompt, start_turn
from lucedesk.engine import Engine, RequestError

OnText = Callable[[str], None]


def failed(error: str) -> TurnResult:
    return TurnResult("", [], "error", 0, 0, error, [])


class Backend(Protocol):
    label: str  # shown to the user: "local engine", a URL

    async def turn(
        self, req: TurnRequest, owner: str, on_text: OnText, on_reasoning: OnText
    ) -> TurnResult: ...

    async def context_limit(self) -> int | None:
        """The most tokens one request holds (prompt and reply); None when unknown."""
        ...

    def count(self, texts: Iterable[str]) -> list[int]:
        """Each text's tokens."""
        ...

    def prompt_tokens(self, req: TurnRequest) -> int:
        """The tokens of `req`'s prompt as the model reads it."""
        ...


class EngineBackend:
    """The in-process engine. `engine` is called per turn, so a model switched at run time
    serves the next turn."""

    label = "local engine"

    def __init__(self, engine: Callable[[], Engine]) -> None:
        self.engine = engine

    async def turn(
        self, req: TurnRequest, owner: str, on_text: OnText, on_reasoning: OnText
    ) -> TurnResult:
        try:  # while a model loads the engine refuses (RequestError) as a full queue does
            turn = await start_turn(self.engine(), req, owner)
        except RequestError as exc:
            return failed(str(exc))
        return await turn.collect(on_text, on_reasoning)

    async def context_limit(self) -> int | None:
        try:
            return self.engine().max_request_tokens
        except RequestError:  # no model runs now
            return None

    def count(self, texts: Iterable[str]) -> list[int]:
        tokenizer = self.engine().tokenizer
        return [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def prompt_tokens(self, req: TurnRequest) -> int:
        # Measured without the reply's grammar: compiling one is not needed to count.
        return count_prompt(
            self.engine(), replace(req, tool_choice=ToolChoice(), response_format=None)
        )


def wire_body(req: TurnRequest, model: str) -> dict:
    body: dict = {
        "model": model,
        "messages": [m.openai() for m in req.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for key in ("max_tokens", "temperature", "top_p", "seed"):
        if getattr(req.sampling, key) is not None:
            body[key] = getattr(req.sampling, key)
    if req.sampling.stop:
        body["stop"] = list(req.sampling.stop)
    if req.tools:
        body["tools"] = [t.openai() for t in req.tools]
        choice = req.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.function}}
            if choice.mode == "function"
            else choice.mode
        )
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.reasoning is not None:
        body["reasoning_effort"] = req.reasoning
    if req.continue_final:  # vLLM's names, which lucedesk serve takes too
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    if req.response_format is not None:
        schema = json.loads(req.response_format.source)
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": schema, "strict": True},
        }
    return body


def header_value(text: str) -> str:
    """`text` as a header may carry it: printable ASCII, no spaces (a session's owner holds
    its title, whatever the person typed: `Résumé: list the files`)."""
    return "".join(c if 32 < ord(c) < 127 else "_" for c in text).strip("_") or "agent"


def api_base(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class OpenAIBackend:
    """An OpenAI-compatible server, streamed over /v1/chat/completions."""

    def __init__(self, url: str, api_key: str | None = None, model: str = "default") -> None:
        self.url = api_base(url)
        self.label = self.url
        self.api_key = api_key
        self.model = model
        self._context: int | None = None
        self._asked = False

    async def turn(
        self, req: TurnRequest, owner: str, on_text: OnText, on_reasoning: OnText
    ) -> TurnResult:
        headers = {"X-Lucedesk-Client": header_value(owner)}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        text: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict] = {}
        finish, usage = "stop", {}
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as http:
                async with http.stream(
                    "POST",
                    self.url + "/chat/completions",
                    json=wire_body(req, self.model),
                    headers=headers,
                ) as r:
                    if r.status_code != 200:
                        return failed(f"{self.url} answered {r.status_code}: {await error_text(r)}")
                    async for line in r.aiter_lines():
                        data = line.removeprefix("data:").strip()
                        if not line.startswith("data:") or data == "[DONE]":
                            continue
                        event = json.loads(data)
                        if not isinstance(event, dict):
                            return failed(f"{self.url}: a stream event that is not an object")
                        if event.get("error"):
                            return failed(f"{self.url}: {error_message(event['error'])}")
                        usage = event.get("usage") or usage
                        for choice in event.get("choices") or []:
                            delta = choice.get("delta") or {}
                            # llama.cpp's name, else vLLM's
                            thought = delta.get("reasoning_content") or delta.get("reasoning")
                            if isinstance(thought, str) and thought:
                                reasoning.append(thought)
                                on_reasoning(thought)
                            if delta.get("content"):
                                text.append(delta["content"])
                                on_text(delta["content"])
                            for piece in delta.get("tool_calls") or []:
                                call = call_of(calls, piece)
                                function = piece.get("function") or {}
                                call["id"] = piece.get("id") or call["id"]
                                call["name"] += function.get("name") or ""
                                call["arguments"] += function.get("arguments") or ""
                            finish = choice.get("finish_reason") or finish
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, TypeError, AttributeError) as exc:
            return failed(f"{self.url}: {exc or type(exc).__name__}")
        tool_calls = [
            ToolCall(c["id"] or ToolCall.new_id(), c["name"], c["arguments"] or "{}")
            for c in calls.values()
        ]
        if finish not in ("stop", "length", "tool_calls"):
            finish = "stop"
        return TurnResult(
            "".join(text),
            tool_calls,
            finish,
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", 0),
            None,
            [],
            reasoning="".join(reasoning),
        )

    async def context_limit(self) -> int | None:
        """The served model's context, as its listing says (lucedesk and vLLM:
        `max_model_len`, others `context_length`, llama.cpp `meta.n_ctx_train`); asked once."""
        if not self._asked:
            self._asked = True
            self._context = await listed_context(self.url, self.model, self.api_key)
        return self._context

    def count(self, texts: Iterable[str]) -> list[int]:
        return [len(t) // CHARS_PER_TOKEN + 1 for t in texts]

    def prompt_tokens(self, req: TurnRequest) -> int:
        return self.count([json.dumps(wire_body(req, self.model))])[0]


# Characters per token where the tokenizer is the server's: English runs near four, code and
# other languages fewer; three errs toward compacting early.
CHARS_PER_TOKEN = 3


async def listed_context(url: str, model: str, api_key: str | None) -> int | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(url + "/models", headers=headers)
            listing = r.json().get("data") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    entries = [e for e in listing if isinstance(e, dict)] if isinstance(listing, list) else []
    named = [e for e in entries if e.get("id") == model]
    for entry in named or (entries if len(entries) == 1 else []):
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        for value in (
            entry.get("max_model_len"),
            entry.get("context_length"),
            meta.get("n_ctx_train"),
        ):
            if isinstance(value, int) and value > 0:
                return value
    return None


def call_of(calls: dict, piece: dict) -> dict:
    """The call a streamed tool-call piece belongs to, by its `index`; servers that send no
    index start a new call with each new id and continue the last one without."""
    index = piece.get("index")
    if not isinstance(index, int):
        new_id = piece.get("id")
        known = [k for k, c in calls.items() if new_id and c["id"] == new_id]
        if known:
            index = known[0]
        elif new_id or not calls:
            index = len(calls) + 1_000_000  # after any indexed call
        else:
            index = list(calls)[-1]
    return calls.setdefault(index, {"id": "", "name": "", "arguments": ""})


def error_message(error) -> str:
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)


async def error_text(r: httpx.Response) -> str:
    text = (await r.aread()).decode(errors="replace")
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:300]
