"""The OpenAI wire format: request bodies (validated by pydantic) and their translation into
a chat turn (`to_turn_request`: messages, tools, tool choice, grammar, sampling). The
answers' shapes and the routes are openai_api.py's."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lucedesk.chat import (
    CallLedger,
    ChatMessage,
    RawPrompt,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
    TurnRequest,
    WireNames,
    json_object,
    schema_grammar,
)
from lucedesk.engine import MAX_TOP_LOGPROBS, Grammar, RequestError
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


def to_turn_request(body: ChatCompletionRequest | CompletionRequest) -> TurnRequest:
    """A chat completion's turn, or a text completion's raw one."""
    if isinstance(body, CompletionRequest):
        if isinstance(body.prompt, str):
            raw = RawPrompt(text=body.prompt)
        elif body.prompt and all(isinstance(p, str) for p in body.prompt):
            if len(body.prompt) != 1:
                raise RequestError("only one prompt per request is supported", "prompt")
            raw = RawPrompt(text=str(body.prompt[0]))
        else:
            raw = RawPrompt(ids=[int(p) for p in body.prompt])
        return TurnRequest(
            raw=raw,
            response_format=grammar_of(body.response_format),
            sampling=sampling_of(body, body.max_tokens, body.logprobs),
            names=WireNames("prompt"),
        )
    return TurnRequest(
        messages=messages_of(body),
        tools=tools_of(body),
        tool_choice=tool_choice_of(body),
        parallel_tool_calls=body.parallel_tool_calls is not False and not body.legacy_functions,
        reasoning=reasoning_of(body),
        continue_final=body.continue_final_message,
        response_format=grammar_of(body.response_format),
        sampling=sampling_of(
            body,
            body.max_completion_tokens or body.max_tokens,
            (body.top_logprobs or 0) if body.logprobs else None,
        ),
    )


def sampling_of(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> Sampling:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return Sampling(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=tuple(stop),
        ignore_eos=bool(body.ignore_eos),
        speculative=body.speculative,
        logprobs=logprobs,
    )


def grammar_of(fmt: ResponseFormat | None) -> Grammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_object("response_format")
    if fmt.json_schema is None:
        raise RequestError(
            "response_format.json_schema is required when type is 'json_schema'",
            "response_format.json_schema",
        )
    return schema_grammar(fmt.json_schema.schema_, "response_format")


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
