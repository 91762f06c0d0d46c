"""The chat layer's front door: typed chat messages, a chat encoded into tokens and the
grammar its reply must follow, and a turn (a request in, text, reasoning and tool-call
events out). It sits on the engine, which knows tokens only:

    prompt = ChatEncoder.of(engine).encode(messages, tools, tool_choice, response_format=...)
    params = SamplingParams(max_tokens=engine.output_room(len(prompt.token_ids), None),
                            grammar=prompt.grammar)
    handle = engine.submit(prompt.token_ids, params, owner="me")
    async for out in handle: ...            # RequestOutput deltas; prompt.parser() reads calls

or, for a chat turn with its reply read as text and tool-call events, in one call:

    turn = submit_turn(engine, TurnRequest(messages, tools, tool_choice), owner="me")

Clients import from here, never from the modules behind it.
"""

from __future__ import annotations

from lucedesk.chat.encoder import ChatEncoder, ChatPrompt
from lucedesk.chat.formats import CallFormat, format_of, reasoning_format
from lucedesk.chat.json_schema import json_object, schema_grammar
from lucedesk.chat.messages import CallLedger, ChatMessage, Tool, ToolCall, ToolChoice
from lucedesk.chat.tool_parser import CallDelta, TextDelta, ToolCallParser
from lucedesk.chat.turn import (
    ReasoningPiece,
    TextPiece,
    Turn,
    TurnEnd,
    TurnEvent,
    TurnResult,
    count_prompt,
    start_turn,
    submit_turn,
)
from lucedesk.chat.turn_request import RawPrompt, Sampling, TurnRequest, WireNames

__all__ = [
    "CallDelta",
    "CallFormat",
    "CallLedger",
    "ChatEncoder",
    "ChatMessage",
    "ChatPrompt",
    "RawPrompt",
    "ReasoningPiece",
    "Sampling",
    "TextDelta",
    "TextPiece",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolChoice",
    "Turn",
    "TurnEnd",
    "TurnEvent",
    "TurnRequest",
    "TurnResult",
    "WireNames",
    "format_of",
    "json_object",
    "reasoning_format",
    "schema_grammar",
    "count_prompt",
    "start_turn",
    "submit_turn",
]
