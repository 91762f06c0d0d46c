"""The OpenAI wire format: request bodies (validated by pydantic), their translation into
engine terms (messages, tools, tool choice, grammar), and the response and stream-chunk
shapes built from engine outputs. No routes here: app.py wires these to the engine."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lucedesk.engine import (
    MAX_TOP_LOGPROBS,
    CallDelta,
    CallLedger,
    ChatMessage,
    Engine,
    Grammar,
    RequestError,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolChoice,
)
from lucedesk.server.errors import not_text

log = logging.getLogger(__name__)

# -- requests ---------------------------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """A part that is not text (image_url, input_audio, file): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # the legacy functions API's one call
    # An earlier reply's reasoning, as llama.cpp (reasoning_content) and vLLM (reasoning)
    # send it back.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self, field: str = "content") -> str:
        """The text; raises RequestError naming a part that is not text (`field[j]`)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            if not isinstance(part, TextPart):
                raise RequestError(f"{field}[{j}]: {not_text(part.type)}", f"{field}")
        return "".join(part.text for part in self.content)


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints; unknown fields are accepted and ignored, as the
    OpenAI clients send optional ones freely."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=1, ge=1)
    response_format: ResponseFormat | None = None
    # Extensions (vLLM and llama.cpp spell them the same way).
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool | None = False
    speculative: bool | None = None  # prompt-lookup drafts (lucedesk); null = the server's


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(SamplingFields):
    messages: list[MessageIn] = Field(min_length=1)
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: write on from the last (assistant) message instead of starting a new one
    continue_final_message: bool = False
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # The legacy functions API: one call per reply, answered in `function_call`.
    functions: list[FunctionDef] | None = None
    function_call: Literal["auto", "none"] | NamedFunction | None = None

    @property
    def legacy_functions(self) -> bool:
        return self.functions is not None and self.tools is None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


# -- requests into engine terms -----------------------------------------------------------------


def grammar_of(fmt: ResponseFormat | None) -> Grammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar.json_object("response_format")
    if fmt.json_schema is None:
        raise RequestError(
            "response_format.json_schema is required when type is 'json_schema'",
            "response_format.json_schema",
        )
    return Grammar.json_schema(fmt.json_schema.schema_, "response_format")


def reasoning_of(body: ChatCompletionRequest) -> str | None:
    """The reasoning level asked for: `reasoning_effort`, or `enable_thinking` in
    `chat_template_kwargs` (false: none)."""
    if body.reasoning_effort is not None:
        return body.reasoning_effort
    enable = (body.chat_template_kwargs or {}).get("enable_thinking")
    if enable is None:
        return None
    if not isinstance(enable, bool):
        field = "chat_template_kwargs.enable_thinking"
        raise RequestError(f"{field} must be true or false", field)
    return "medium" if enable else "none"


def tools_of(body: ChatCompletionRequest) -> list[Tool]:
    functions = (body.functions or []) if body.legacy_functions else []
    if body.functions and not body.legacy_functions:
        log.info("chat: `functions` sent beside `tools`; the tools are offered, not them")
    tools = []
    for f in [t.function for t in body.tools or []] + functions:
        params = f.parameters or {"type": "object", "properties": {}}
        tools.append(Tool(f.name, f.description or "", params))
    return tools


def tool_choice_of(body) -> ToolChoice:
    """OpenAI's `tool_choice` (of any body that takes it: Ollama's chat takes it too), or
    the legacy `function_call`."""
    choice = body.tool_choice
    if choice is None and getattr(body, "legacy_functions", False):
        choice = body.function_call
        if isinstance(choice, NamedFunction):
            return ToolChoice("function", choice.name)
    if isinstance(choice, NamedToolChoice):
        return ToolChoice("function", choice.function.name)
    return ToolChoice(choice or "auto")


def messages_of(body: ChatCompletionRequest) -> list[ChatMessage]:
    """The chat, typed. Raises RequestError naming the field for call arguments that are
    not JSON and results for calls never made."""
    out: list[ChatMessage] = []
    ledger = CallLedger()
    legacy_calls: dict[str, str] = {}  # function name -> id of its last legacy call
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        if role == "assistant" and m.function_call is not None and not m.tool_calls:
            # A legacy call has no id: it gets one, and its result (role function) is
            # matched to it by the function's name.
            call_id = f"call_{i}"
            legacy_calls[m.function_call.name] = call_id
            m = m.model_copy(
                update={"tool_calls": [ToolCallIn(id=call_id, function=m.function_call)]}
            )
        if role == "function":
            field = f"messages[{i}].name"
            if not m.name or m.name not in legacy_calls:
                raise RequestError(
                    f"{field} {m.name!r} names no function_call of an earlier message", field
                )
            role = "tool"
            m = m.model_copy(update={"tool_call_id": legacy_calls.pop(m.name)})
        text = m.text(f"messages[{i}].content")
        if role == "tool":
            field = f"messages[{i}].tool_call_id"
            if not m.tool_call_id:
                raise RequestError(f"{field} is required for a tool message", field)
            out.append(ledger.answer(m.tool_call_id, text, field, "tool call"))
            continue
        calls = [
            ledger.made(
                ToolCall(c.id, c.function.name, c.function.arguments),
                f"messages[{i}].tool_calls[{j}].function.arguments",
            )
            for j, c in enumerate((m.tool_calls or []) if role == "assistant" else [])
        ]
        reasoning = (m.reasoning_content or m.reasoning or "") if role == "assistant" else ""
        out.append(ChatMessage(role, text, calls, reasoning))
    return out


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
