"""The engine's front door: every name a client (the chat layer, server, TUI, agents, CLI,
bench) needs. The engine knows tokens, never chat messages:

    params = SamplingParams(max_tokens=engine.output_room(len(token_ids), None), grammar=g)
    handle = engine.submit(token_ids, params, owner="me")
    async for out in handle: ...            # RequestOutput deltas

A chat becomes tokens and a grammar in the chat layer (lucedesk.chat: ChatEncoder, or a
whole turn with submit_turn).

Clients import from here, never from the modules behind it. This module imports no torch;
the names that build an engine (and load torch) are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lucedesk.engine.engine import Engine, EngineNotReady, ModelInfo, QueueFullError
from lucedesk.engine.grammar import JSON_OPTIONS, Grammar
from lucedesk.engine.handle import Completion, RequestHandle, RequestOutput, TokenLogprob
from lucedesk.engine.models.harmony_tokens import ENDS as HARMONY_ENDS
from lucedesk.engine.models.harmony_tokens import MARKERS as HARMONY_MARKERS
from lucedesk.engine.models.harmony_tokens import is_harmony
from lucedesk.engine.models.tokenizer import Tokenizer
from lucedesk.engine.output import overlap_with_start
from lucedesk.engine.request import MAX_TOP_LOGPROBS, FinishReason, SamplingParams
from lucedesk.engine.stats import EngineStats, HistogramSnapshot, SlotStats
from lucedesk.errors import ContextOverflow, RequestError

if TYPE_CHECKING:
    from lucedesk.engine.build import (
        BuiltEngine,
        check_device,
        disk_cache_root,
        kernel_build_notice,
        launch_engine,
        resolve_device,
        resolve_dtype,
        wait_for_writers,
        weight_cache_root,
    )
    from lucedesk.engine.memory import (
        available_memory,
        dtype_name,
        fit_now,
        memory_basis,
        return_free_memory,
        unreadable,
    )
    from lucedesk.engine.models.loader import read_model_config

_BUILD_NAMES = (
    "BuiltEngine",
    "check_device",
    "disk_cache_root",
    "kernel_build_notice",
    "launch_engine",
    "resolve_device",
    "resolve_dtype",
    "wait_for_writers",
    "weight_cache_root",
)
_MEMORY_NAMES = (
    "available_memory",
    "dtype_name",
    "fit_now",
    "memory_basis",
    "memory_basis",
    "return_free_memory",
    "unreadable",
)

__all__ = [
    "HARMONY_ENDS",
    "HARMONY_MARKERS",
    "JSON_OPTIONS",
    "MAX_TOP_LOGPROBS",
    "BuiltEngine",
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
    "RequestError",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "SlotStats",
    "TokenLogprob",
    "Tokenizer",
    "check_device",
    "disk_cache_root",
    "is_harmony",
    "overlap_with_start",
    "kernel_build_notice",
    "read_model_config",
    "available_memory",
    "dtype_name",
    "fit_now",
    "memory_basis",
    "return_free_memory",
    "unreadable",
    "resolve_device",
    "resolve_dtype",
    "launch_engine",
    "wait_for_writers",
    "weight_cache_root",
]


def __getattr__(name: str):
    if name in _BUILD_NAMES:
        from lucedesk.engine import build

        return getattr(build, name)
    if name in _MEMORY_NAMES:
        from lucedesk.engine import memory

        return getattr(memory, name)
    if name == "read_model_config":
        from lucedesk.engine.models.loader import read_model_config

        return read_model_config
    raise AttributeError(f"module 'lucedesk.engine' has no attribute {name!r}")
