"""OpenAI chat and text completions: `POST /v1/chat/completions`, `POST /v1/completions`.
The wire format lives in openai_wire.py; this module turns it into chat turns and back."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from lucedesk.chat import CallDelta, ReasoningPiece, TextPiece, ToolCall, Turn, TurnEnd
from lucedesk.engine import Engine, TokenLogprob
from lucedesk.server import errors
from lucedesk.server import openai_wire as wire
from lucedesk.server.errors import APIError, generation_failed
from lucedesk.server.openai_wire import ChatCompletionRequest, CompletionRequest, SamplingFields
from lucedesk.server.replies import Json, TurnStream, dumps
from lucedesk.server.served import Served, complete, start_client_turn


def routes(served: Served) -> APIRouter:
    router = APIRouter()

    def check_common(body: SamplingFields) -> None:
        served.check_model(body.model)
        if body.n not in (None, 1):
            raise APIError(400, "n must be 1", "n")

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_common(body)
        turn_request = wire.to_turn_request(body)
        turn = await start_client_turn(served.engine(), turn_request, request)
        reply = Reply(served, turn, True, bool(body.logprobs), body.legacy_functions)
        return await reply.answer(body, request)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_common(body)
        turn_request = wire.to_turn_request(body)
        turn = await start_client_turn(served.engine(), turn_request, request)
        reply = Reply(served, turn, chat=False, logprobs=body.logprobs is not None)
        return await reply.answer(body, request)

    return router


class Reply:
    """One completion's answer: a JSON body or an SSE stream of chunks."""

    def __init__(
        self, served: Served, turn: Turn, chat: bool, logprobs: bool, legacy: bool = False
    ) -> None:
        self.turn, self.chat, self.want_logprobs = turn, chat, logprobs
        self.legacy_functions = legacy  # answer calls as the legacy `function_call`
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = served.model_id
        self.format_logprobs = LogprobFormatter(turn.engine)
        self.text_offset = 0  # of the next streamed token, for text completions' logprobs

    async def answer(self, body: SamplingFields, request: Request):
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return TurnStream(self.turn, self.stream(include_usage))
        done = await complete(self.turn, request)
        logprobs = None
        if self.want_logprobs:
            fmt = self.format_logprobs
            logprobs = fmt.chat(done.logprobs) if self.chat else fmt.completion(done.logprobs)
        if self.chat:
            shape = legacy_message_of if self.legacy_functions else message_of
            choice = {
                "index": 0,
                "message": shape(done.text, done.calls, done.reasoning),
                "finish_reason": self.finish_reason(done.finish),
                "logprobs": logprobs,
            }
        else:
            choice = {
                "index": 0,
                "text": done.text,
                "finish_reason": done.finish,
                "logprobs": logprobs,
            }
        return Json(
            {
                "id": self.rid,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": usage(
                    done.num_prompt_tokens, done.num_output_tokens, done.num_cached_tokens
                ),
            }
        )

    def finish_reason(self, finish: str) -> str:
        return "function_call" if finish == "tool_calls" and self.legacy_functions else finish

    def event(self, choice: dict | None, usage: dict | None = None) -> str:
        payload = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if usage is not None:
            payload["usage"] = usage
        return f"data: {dumps(payload)}\n\n"

    def piece(self, delta: dict, logprobs: tuple = (), reason: str | None = None) -> dict:
        lp = None
        if self.want_logprobs and logprobs and self.chat:
            lp = self.format_logprobs.chat(logprobs)
        elif self.want_logprobs and logprobs:  # offsets run on across the chunks
            lp = self.format_logprobs.completion(logprobs, self.text_offset)
            self.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if self.chat:
            return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": lp}
        text = delta.get("content", "")
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": lp}

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        if self.chat:
            yield self.event(self.piece({"role": "assistant", "content": ""}))
        async for event in self.turn.events():
            if isinstance(event, TextPiece):
                if event.text or (event.logprobs and self.want_logprobs):
                    delta = {"content": event.text} if event.text else {}
                    yield self.event(self.piece(delta, event.logprobs))
            elif isinstance(event, ReasoningPiece):
                yield self.event(self.piece(reasoning_delta(event.text)))
            elif isinstance(event, CallDelta):
                if not self.legacy_functions:
                    yield self.event(self.piece(call_delta(event)))
                elif event.index == 0:  # the legacy API holds one call
                    yield self.event(self.piece(legacy_call_delta(event)))
            elif isinstance(event, TurnEnd):
                if event.logprobs and self.want_logprobs:
                    yield self.event(self.piece({}, event.logprobs))
                if event.finish == "error":
                    body = errors.error_body(
                        generation_failed(event.error).message, "server_error", None, "500"
                    )
                    yield f"data: {dumps(body)}\n\n"
                else:
                    yield self.event(self.piece({}, (), self.finish_reason(event.finish)))
                if include_usage:
                    counts = usage(
                        event.num_prompt_tokens, event.num_output_tokens, event.num_cached_tokens
                    )
                    yield self.event(None, counts)
        yield "data: [DONE]\n\n"


# -- responses --------------------------------------------------------------------------------


def usage(num_prompt: int, num_output: int, num_cached: int = 0) -> dict:
    """`cached_tokens`: prompt tokens the prefix cache held (not computed again)."""
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


class LogprobFormatter:
    """Token logprobs as OpenAI shows them: chat's `content` list and the text completion's
    parallel lists."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.engine.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat(self, logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict:
        content = []
        for lp in logprobs:
            text, raw = self._token(lp.token_id)
            top = []
            for tid, value in lp.top:
                t, b = self._token(tid)
                top.append({"token": t, "logprob": value, "bytes": b})
            content.append(
                {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}
            )
        return {"content": content, "refusal": None}

    def completion(self, logprobs, text_offset: int = 0) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            text, _ = self._token(lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            top: dict[str, float] = {}
            for tid, v in lp.top:  # tokens of equal text share a key: the likelier one stays
                top.setdefault(self._token(tid)[0], v)
            tops.append(top)
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def message_of(content: str, calls: list[ToolCall], reasoning: str = "") -> dict:
    """The assistant message of a whole reply: content (None when only calls were made and
    nothing but whitespace surrounds them), tool_calls, and the reasoning under both names
    clients read it by (llama.cpp's reasoning_content, vLLM's reasoning)."""
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["content"] = content if content.strip() else None
        message["tool_calls"] = [c.openai() for c in calls]
    if reasoning:
        message |= reasoning_delta(reasoning)
    return message


def legacy_message_of(content: str, calls: list[ToolCall], reasoning: str = "") -> dict:
    """The reply for the legacy functions API: its one call as `function_call`."""
    message = message_of(content, calls[:1], reasoning)
    if message.pop("tool_calls", None):
        call = calls[0]
        message["function_call"] = {"name": call.name, "arguments": call.arguments}
    return message


def reasoning_delta(text: str) -> dict:
    return {"reasoning_content": text, "reasoning": text}


def call_delta(event: CallDelta) -> dict:
    """A stream chunk's delta for one piece of a call: id, type and name on its first piece,
    then arguments fragments, each under the call's index."""
    if event.id is not None:
        function = {"name": event.name, "arguments": event.arguments}
        call = {"index": event.index, "id": event.id, "type": "function", "function": function}
    else:
        call = {"index": event.index, "function": {"arguments": event.arguments}}
    return {"tool_calls": [call]}


def legacy_call_delta(event: CallDelta) -> dict:
    """call_delta for the legacy functions API: `function_call`, name on the first piece."""
    if event.id is not None:
        return {"function_call": {"name": event.name, "arguments": event.arguments}}
    return {"function_call": {"arguments": event.arguments}}
