"""The engine's front door: every name a client (server, TUI, agents, CLI, bench) needs.

    prompt = engine.encode_chat(messages, tools, tool_choice, response_format=...)
    params = SamplingParams(max_tokens=engine.output_room(len(prompt.token_ids), None),
                            grammar=prompt.grammar)
    handle = engine.submit(prompt.token_ids, params, owner="me")
    async for out in handle: ...            # RequestOutput deltas; prompt.parser() reads calls

or, for a chat turn with its reply read as text and tool-call events, in one call:

    turn = submit_turn(engine, TurnRequest(messages, tools, tool_choice), owner="me")

Clients import from here, never from the modules behind it. This module imports no torch;
the names that build an engine (and load torch) are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lucedesk.engine.chat_encoder import ChatPrompt
from lucedesk.engine.engine import Engine, EngineNotReady, ModelInfo, QueueFullError
from lucedesk.engine.grammar import Grammar
from lucedesk.engine.handle import Completion, RequestHandle, RequestOutput, TokenLogprob
from lucedesk.engine.messages import CallLedger, ChatMessage, Tool, ToolCall, ToolChoice
from lucedesk.engine.request import MAX_TOP_LOGPROBS, FinishReason, SamplingParams
from lucedesk.engine.stats import EngineStats, HistogramSnapshot, SlotStats
from lucedesk.engine.tool_parser import CallDelta, TextDelta, ToolCallParser
from lucedesk.engine.turn import (
    ReasoningPiece,
    TextPiece,
    Turn,
    TurnEnd,
    TurnEvent,
    TurnRequest,
    TurnResult,
    start_turn,
    submit_turn,
)
from lucedesk.errors import ContextOverflow, RequestError

if TYPE_CHECKING:
    from lucedesk.engine.build import (
        BuiltEngine,
        available_memory,
        check_device,
        derive_pool_tokens,
        kernel_build_notice,
        kv_bytes_per_token,
        launch_engine,
        resolve_device,
        resolve_dtype,
    )
    from lucedesk.engine.memory import Fit, MemoryNeed, return_free_memory
    from lucedesk.engine.memory import estimate as estimate_memory
    from lucedesk.engine.models.loader import read_model_config

_BUILD_NAMES = (
    "BuiltEngine",
    "available_memory",
    "check_device",
    "derive_pool_tokens",
    "kernel_build_notice",
    "kv_bytes_per_token",
    "launch_engine",
    "resolve_device",
    "resolve_dtype",
)

__all__ = [
    "MAX_TOP_LOGPROBS",
    "BuiltEngine",
    "CallDelta",
    "CallLedger",
    "ChatMessage",
    "ChatPrompt",
    "Completion",
    "ContextOverflow",
    "Engine",
    "EngineNotReady",
    "EngineStats",
    "FinishReason",
    "Grammar",
    "HistogramSnapshot",
    "ModelInfo",
    "QueueFullError",
    "ReasoningPiece",
    "RequestError",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "SlotStats",
    "TextDelta",
    "TextPiece",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolChoice",
    "Turn",
    "TurnEnd",
    "TurnEvent",
    "TurnRequest",
    "TurnResult",
    "check_device",
    "kernel_build_notice",
    "available_memory",
    "derive_pool_tokens",
    "kv_bytes_per_token",
    "read_model_config",
    "Fit",
    "MemoryNeed",
    "return_free_memory",
    "estimate_memory",
    "resolve_device",
    "resolve_dtype",
    "launch_engine",
    "start_turn",
    "submit_turn",
]


def __getattr__(name: str):
    if name in _BUILD_NAMES:
        from lucedesk.engine import build

        return getattr(build, name)
    if name in ("Fit", "MemoryNeed", "estimate_memory", "return_free_memory"):
        from lucedesk.engine import memory

        return getattr(memory, "estimate" if name == "estimate_memory" else name)
    if name == "read_model_config":
        from lucedesk.engine.models.loader import read_model_config

        return read_model_config
    raise AttributeError(f"module 'lucedesk.engine' has no attribute {name!r}")
