"""OpenAI Responses: `POST /v1/responses`, stateless (nothing is stored, so a request naming a
`previous_response_id` is refused): what Codex CLI and the `openai` SDK's responses call."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from lucedesk.engine import (
    CallDelta,
    ReasoningPiece,
    TextPiece,
    ToolCall,
    ToolChoice,
    TurnEnd,
    TurnRequest,
    TurnResult,
)
from lucedesk.server.errors import APIError, generation_failed
from lucedesk.server.replies import Json, TurnStream, dumps
from lucedesk.server.responses_wire import (
    FunctionChoice,
    ResponsesRequest,
    grammar_of,
    messages_of,
    tools_of,
)
from lucedesk.server.served import Served, complete, start_client_turn

log = logging.getLogger(__name__)


class Response:
    """Builds the response object and its output items, whole or as stream events."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body = body
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.sequence = 0

    def envelope(
        self, status: str, output: list[dict], usage: dict | None, finish: str | None
    ) -> dict:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": {"type": "text"}}
            if body.text is None
            else body.text.model_dump(by_alias=True),
            "tool_choice": body.tool_choice
            if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(),
            "tools": [t.model_dump() for t in body.tools or []],
            "metadata": {},
        }

    @staticmethod
    def usage(end: TurnEnd | TurnResult) -> dict:
        num_prompt, num_output = end.num_prompt_tokens, end.num_output_tokens
        return {
            "input_tokens": num_prompt,
            "input_tokens_details": {
                "cached_tokens": end.num_cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt + num_output,
        }

    @staticmethod
    def message_item(item_id: str, text: str, status: str = "completed") -> dict:
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed"
            else [],
        }

    @staticmethod
    def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
        """Raw reasoning as `reasoning_text` content; no summary is written."""
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    @staticmethod
    def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": status,
        }

    def whole(self, done: TurnResult) -> dict:
        output = []
        if done.reasoning:
            output.append(self.reasoning_item("rs_" + uuid.uuid4().hex[:24], done.reasoning))
        if done.text.strip() or not done.calls:
            output.append(self.message_item("msg_" + uuid.uuid4().hex[:24], done.text))
        output += [self.call_item("fc_" + uuid.uuid4().hex[:24], c) for c in done.calls]
        if done.cut_call:  # max_output_tokens ended it mid-arguments
            output[-1]["status"] = "incomplete"
        status = "incomplete" if done.finish == "length" else "completed"
        usage = self.usage(done)
        return self.envelope(status, output, usage, done.finish)

    def event(self, kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps(payload)}\n\n"

    async def stream(self, turn) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.envelope("in_progress", [], None, None))
        yield self.event(
            "response.in_progress", response=self.envelope("in_progress", [], None, None)
        )
        output: list[dict] = []
        item: dict | None = None  # the open output item
        text = ""

        def close_item(call_status: str = "completed"):
            nonlocal item, text
            events = []
            index = len(output)
            loc = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": []}
                events.append(
                    self.event("response.output_text.done", **loc, text=text, logprobs=[])
                )
                events.append(self.event("response.content_part.done", **loc, part=part))
                item = self.message_item(item["id"], text)
            elif item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                events.append(self.event("response.reasoning_text.done", **loc, text=text))
                events.append(self.event("response.content_part.done", **loc, part=part))
                item = self.reasoning_item(item["id"], text)
            else:
                item["status"] = call_status
                events.append(
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                    )
                )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
            output.append(item)
            item, text = None, ""
            return events

        def open_item(kind: str, part: dict):
            nonlocal item
            events = []
            if item is not None and item["type"] != kind:
                events += close_item()
            if item is None:
                make = self.message_item if kind == "message" else self.reasoning_item
                item = make(
                    ("msg_" if kind == "message" else "rs_") + uuid.uuid4().hex[:24],
                    "",
                    "in_progress",
                )
                index = len(output)
                events.append(
                    self.event("response.output_item.added", output_index=index, item=item)
                )
                events.append(
                    self.event(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                )
            return events

        async for event in turn.events():
            if isinstance(event, ReasoningPiece) and event.text:
                for e in open_item("reasoning", {"type": "reasoning_text", "text": ""}):
                    yield e
                text += event.text
                yield self.event(
                    "response.reasoning_text.delta",
                    item_id=item["id"],
                    output_index=len(output),
                    content_index=0,
                    delta=event.text,
                )
            elif isinstance(event, TextPiece) and event.text:
                part = {"type": "output_text", "text": "", "annotations": []}
                for e in open_item("message", part):
                    yield e
                text += event.text
                yield self.event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=len(output),
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            elif isinstance(event, CallDelta):
                if event.id is not None:
                    if item is not None:
                        for e in close_item():
                            yield e
                    call = ToolCall(event.id, event.name or "", "")
                    item = self.call_item("fc_" + uuid.uuid4().hex[:24], call, "in_progress")
                    yield self.event(
                        "response.output_item.added", output_index=len(output), item=item
                    )
                if event.arguments:
                    item["arguments"] += event.arguments
                    yield self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=len(output),
                        delta=event.arguments,
                    )
            elif isinstance(event, TurnEnd):
                if item is not None:  # a call max_output_tokens ended is incomplete
                    for e in close_item("incomplete" if event.cut_call else "completed"):
                        yield e
                if event.finish == "error":
                    failed = self.envelope("failed", output, None, None)
                    failed["error"] = {
                        "code": "server_error",
                        "message": generation_failed(event.error).message,
                    }
                    yield self.event("response.failed", response=failed)
                    return
                usage = self.usage(event)
                if event.finish == "length":
                    done = self.envelope("incomplete", output, usage, "length")
                    yield self.event("response.incomplete", response=done)
                else:
                    done = self.envelope("completed", output, usage, event.finish)
                    yield self.event("response.completed", response=done)


def routes(served: Served) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        served.check_model(body.model)
        if body.previous_response_id is not None:
            raise APIError(
                400,
                "previous_response_id: responses are not stored here (store: false); send the "
                "whole conversation as input items",
                "previous_response_id",
            )
        choice = body.tool_choice
        turn = await start_client_turn(
            served.engine(),
            TurnRequest(
                messages=messages_of(body),
                tools=tools_of(body),
                tool_choice=ToolChoice("function", choice.name)
                if isinstance(choice, FunctionChoice)
                else ToolChoice(choice or "auto"),
                parallel_tool_calls=body.parallel_tool_calls,
                response_format=grammar_of(body),
                reasoning=body.reasoning.effort if body.reasoning else None,
                max_tokens=body.max_output_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                prompt_field="input",
                field_names={"max_tokens": "max_output_tokens"},
            ),
            request,
        )
        response = Response(body, served.model_id)
        if body.stream:
            return TurnStream(turn, response.stream(turn))
        done = await complete(turn, request)
        return Json(response.whole(done))

    return router
