"""Token utilities in llama.cpp's server's shapes: `POST /tokenize`, `POST /detokenize`,
`POST /apply-template` (the prompt the chat template makes, tools included)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from lucedesk.chat import ChatEncoder
from lucedesk.server import openai_wire as wire
from lucedesk.server.errors import APIError
from lucedesk.server.served import Served


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokens: list[int]


class TemplateRequest(wire.ChatCompletionRequest):
    """The chat request's own fields: messages, tools, tool_choice."""


class TemplateReply(BaseModel):
    prompt: str
    num_tokens: int = Field(description="tokens of the prompt")


def routes(served: Served) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    def tokenize(body: TokenizeRequest) -> dict:
        tokenizer = served.engine().tokenizer
        ids = tokenizer.encode(body.content, add_special_tokens=body.add_special)
        if not body.with_pieces:
            return {"tokens": ids}
        return {
            "tokens": [
                {"id": i, "piece": tokenizer.decode([i], skip_special_tokens=False)} for i in ids
            ]
        }

    @router.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> dict:
        tokenizer = served.engine().tokenizer
        bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary", "tokens")
        return {"content": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @router.post("/apply-template")
    def apply_template(body: TemplateRequest) -> TemplateReply:
        eng = served.engine()
        prompt = ChatEncoder.of(eng).encode(
            wire.messages_of(body),
            wire.tools_of(body),
            wire.tool_choice_of(body),
            body.parallel_tool_calls,
        )
        text = eng.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        return TemplateReply(prompt=text, num_tokens=len(prompt.token_ids))

    return router
