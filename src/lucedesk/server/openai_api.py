"""OpenAI chat and text completions: `POST /v1/chat/completions`, `POST /v1/completions`.
The wire format lives in openai_wire.py; this module turns it into chat turns and back."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from lucedesk.engine import (
    CallDelta,
    ReasoningPiece,
    TextPiece,
    Turn,
    TurnEnd,
    TurnRequest,
)
from lucedesk.server import errors
from lucedesk.server import openai_wire as wire
from lucedesk.server.errors import APIError, generation_failed
from lucedesk.server.openai_wire import ChatCompletionRequest, CompletionRequest, SamplingFields
from lucedesk.server.replies import Json, TurnStream, dumps
from lucedesk.server.served import Served, complete, start_client_turn


def sampling_of(body: SamplingFields, max_tokens: int | None) -> dict:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return dict(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=tuple(stop),
        ignore_eos=bool(body.ignore_eos),
        speculative=body.speculative,
    )


def routes(served: Served) -> APIRouter:
    router = APIRouter()

    def check_common(body: SamplingFields) -> None:
        served.check_model(body.model)
        if body.n not in (None, 1):
            raise APIError(400, "n must be 1", "n")

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_common(body)
        turn_request = TurnRequest(
            messages=wire.messages_of(body),
            tools=wire.tools_of(body),
            tool_choice=wire.tool_choice_of(body),
            parallel_tool_calls=body.parallel_tool_calls is not False and not body.legacy_functions,
            response_format=wire.grammar_of(body.response_format),
            reasoning=wire.reasoning_of(body),
            continue_final=body.continue_final_message,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            **sampling_of(body, body.max_completion_tokens or body.max_tokens),
        )
        turn = await start_client_turn(served.engine(), turn_request, request)
        reply = Reply(served, turn, True, bool(body.logprobs), body.legacy_functions)
        return await reply.answer(body, request)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_common(body)
        engine = served.engine()
        if isinstance(body.prompt, str):
            prompt = {"prompt_text": body.prompt}
        elif body.prompt and all(isinstance(p, str) for p in body.prompt):
            if len(body.prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            prompt = {"prompt_text": body.prompt[0]}
        else:
            prompt = {"prompt_ids": list(body.prompt)}
        turn_request = TurnRequest(
            **prompt,
            prompt_field="prompt",
            response_format=wire.grammar_of(body.response_format),
            logprobs=body.logprobs,
            **sampling_of(body, body.max_tokens),
        )
        turn = await start_client_turn(engine, turn_request, request)
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
        self.format_logprobs = wire.LogprobFormatter(turn.engine)
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
            message_of = wire.legacy_message_of if self.legacy_functions else wire.message_of
            choice = {
                "index": 0,
                "message": message_of(done.text, done.calls, done.reasoning),
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
                "usage": wire.usage(
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
                yield self.event(self.piece(wire.reasoning_delta(event.text)))
            elif isinstance(event, CallDelta):
                if not self.legacy_functions:
                    yield self.event(self.piece(wire.call_delta(event)))
                elif event.index == 0:  # the legacy API holds one call
                    yield self.event(self.piece(wire.legacy_call_delta(event)))
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
                    usage = wire.usage(
                        event.num_prompt_tokens, event.num_output_tokens, event.num_cached_tokens
                    )
                    yield self.event(None, usage)
        yield "data: [DONE]\n\n"
