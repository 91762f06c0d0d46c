"""OpenAI Responses: `POST /v1/responses`, stateless (nothing is stored, so a request naming a
`previous_response_id` is refused): what Codex CLI and the `openai` SDK's responses call."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from lucedesk.chat import (
    CallDelta,
    ReasoningPiece,
    TextPiece,
    ToolCall,
    Turn,
    TurnEnd,
    TurnResult,
)
from lucedesk.server.errors import APIError, generation_failed
from lucedesk.server.replies import Json, TurnStream, dumps
from lucedesk.server.responses_wire import ResponsesRequest, to_turn_request
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


class ResponseStream:
    """One response as its SSE events: output items opened and closed as the turn's events
    arrive (reasoning, then text, then calls), each item's deltas in between."""

    def __init__(self, response: Response) -> None:
        self.r = response
        self.output: list[dict] = []  # the items closed so far
        self.item: dict | None = None  # the open one
        self.text = ""  # the open message's or reasoning's text so far

    async def events(self, turn: Turn) -> AsyncIterator[str]:
        r = self.r
        yield r.event("response.created", response=r.envelope("in_progress", [], None, None))
        yield r.event("response.in_progress", response=r.envelope("in_progress", [], None, None))
        async for event in turn.events():
            if isinstance(event, ReasoningPiece) and event.text:
                for e in self.text_delta("reasoning", event.text):
                    yield e
            elif isinstance(event, TextPiece) and event.text:
                for e in self.text_delta("message", event.text):
                    yield e
            elif isinstance(event, CallDelta):
                for e in self.call_delta(event):
                    yield e
            elif isinstance(event, TurnEnd):
                for e in self.end(event):
                    yield e

    def text_delta(self, kind: str, delta: str) -> list[str]:
        """More text of a message or of reasoning: the item opened first if need be."""
        events = self.open_item(kind)
        self.text += delta
        where = {"item_id": self.item["id"], "output_index": len(self.output), "content_index": 0}
        if kind == "reasoning":
            events.append(self.r.event("response.reasoning_text.delta", **where, delta=delta))
        else:
            events.append(
                self.r.event("response.output_text.delta", **where, delta=delta, logprobs=[])
            )
        return events

    def call_delta(self, event: CallDelta) -> list[str]:
        """A call opens (its id and name) or its arguments grow."""
        events = []
        if event.id is not None:
            if self.item is not None:
                events += self.close_item()
            call = ToolCall(event.id, event.name or "", "")
            self.item = self.r.call_item("fc_" + uuid.uuid4().hex[:24], call, "in_progress")
            events.append(
                self.r.event(
                    "response.output_item.added", output_index=len(self.output), item=self.item
                )
            )
        if event.arguments:
            self.item["arguments"] += event.arguments
            events.append(
                self.r.event(
                    "response.function_call_arguments.delta",
                    item_id=self.item["id"],
                    output_index=len(self.output),
                    delta=event.arguments,
                )
            )
        return events

    def end(self, event: TurnEnd) -> list[str]:
        r, events = self.r, []
        if self.item is not None:  # a call max_output_tokens ended is incomplete
            events += self.close_item("incomplete" if event.cut_call else "completed")
        if event.finish == "error":
            failed = r.envelope("failed", self.output, None, None)
            message = generation_failed(event.error).message
            failed["error"] = {"code": "server_error", "message": message}
            return [*events, r.event("response.failed", response=failed)]
        usage = r.usage(event)
        if event.finish == "length":
            done = r.envelope("incomplete", self.output, usage, "length")
            return [*events, r.event("response.incomplete", response=done)]
        done = r.envelope("completed", self.output, usage, event.finish)
        return [*events, r.event("response.completed", response=done)]

    def open_item(self, kind: str) -> list[str]:
        """A message or reasoning item open to take text: the open one, when of that kind."""
        events = []
        if self.item is not None and self.item["type"] != kind:
            events += self.close_item()
        if self.item is None:
            if kind == "message":
                item = self.r.message_item("msg_" + uuid.uuid4().hex[:24], "", "in_progress")
                part = {"type": "output_text", "text": "", "annotations": []}
            else:
                item = self.r.reasoning_item("rs_" + uuid.uuid4().hex[:24], "", "in_progress")
                part = {"type": "reasoning_text", "text": ""}
            self.item, index = item, len(self.output)
            events.append(self.r.event("response.output_item.added", output_index=index, item=item))
            events.append(
                self.r.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def close_item(self, call_status: str = "completed") -> list[str]:
        r, item, text, events = self.r, self.item, self.text, []
        index = len(self.output)
        loc = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            events.append(r.event("response.output_text.done", **loc, text=text, logprobs=[]))
            events.append(r.event("response.content_part.done", **loc, part=part))
            item = r.message_item(item["id"], text)
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events.append(r.event("response.reasoning_text.done", **loc, text=text))
            events.append(r.event("response.content_part.done", **loc, part=part))
            item = r.reasoning_item(item["id"], text)
        else:
            item["status"] = call_status
            events.append(
                r.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        events.append(r.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.item, self.text = None, ""
        return events


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
        turn = await start_client_turn(served.engine(), to_turn_request(body), request)
        response = Response(body, served.model_id)
        if body.stream:
            return TurnStream(turn, ResponseStream(response).events(turn))
        done = await complete(turn, request)
        return Json(response.whole(done))

    return router
