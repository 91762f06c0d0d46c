"""Reasoning in each protocol's own field, read by its official client over real HTTP: OpenAI
chat `reasoning_content` (and `reasoning`), Responses `reasoning` items, Anthropic `thinking`
blocks, Ollama `thinking`; each protocol's reasoning switch accepted, earlier reasoning sent
back accepted. The models are tiny ones whose replies are scripted (a Qwen3-style thinker,
and gpt-oss's harmony format with a tool call)."""

from __future__ import annotations

import httpx
import pytest
import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.server import create_app, start_server
from tests.conftest import write_tiny_model
from tests.engine_harness import make_engine, script_replies
from tests.test_reasoning import CALL, NEXT, thinking_checkpoint

REASONING, ANSWER = "Weighing it: the capital is Paris.", "Paris."
THINKING_REPLY = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
ASK = [{"role": "user", "content": "Capital of France?"}]


def serve(loaded, reply):
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=8192)
    script_replies(engine, reply)
    engine.start()
    running = start_server(create_app(engine, model_name="tiny"), "127.0.0.1", 0)
    return running, engine


@pytest.fixture(scope="module")
def thinker_url(tmp_path_factory):
    loaded = load_model(thinking_checkpoint(tmp_path_factory.mktemp("thinker")), torch.float32)
    running, engine = serve(loaded, lambda ids: THINKING_REPLY)
    yield running.url
    running.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def harmony_url(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("harmony"), "gpt-oss", harmony=True)
    reply = (
        "<|channel|>analysis<|message|>The user wants the weather; call the tool."
        + NEXT
        + CALL
        + '{"city": "Oslo"}<|call|>'
    )
    running, engine = serve(load_model(folder, torch.float32), lambda ids: reply)
    yield running.url
    running.stop()
    engine.shutdown()


def test_openai_chat_gives_reasoning_content(thinker_url):
    import openai

    client = openai.OpenAI(base_url=thinker_url + "/v1", api_key="x")
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200)
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content, message.reasoning) == (
        ANSWER,
        REASONING,
        REASONING,
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=200,
        stream=True,
        reasoning_effort="high",
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    reasoning, content = "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = getattr(delta, "reasoning_content", None) or ""
        assert not (extra and delta.content), "reasoning and content share no delta"
        reasoning += extra
        content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)
    # Earlier reasoning comes back on assistant messages, under either name.
    history = ASK + [
        {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
        {"role": "user", "content": "And Spain?"},
    ]
    again = client.chat.completions.create(
        model="tiny", messages=history, max_tokens=200, reasoning_effort="none"
    )
    assert again.choices[0].message.content == ANSWER


def test_openai_chat_reasoning_with_a_harmony_call(harmony_url):
    import openai

    client = openai.OpenAI(base_url=harmony_url + "/v1", api_key="x")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=tools,
        max_tokens=400,
        reasoning_effort="low",
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants the weather; call the tool."
    call = choice.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')


def test_responses_give_a_reasoning_item(thinker_url):
    import openai

    client = openai.OpenAI(base_url=thinker_url + "/v1", api_key="x")
    whole = client.responses.create(
        model="tiny", input="Capital of France?", max_output_tokens=200, reasoning={"effort": "low"}
    )
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == REASONING and whole.output_text == ANSWER
    with client.responses.stream(
        model="tiny", input="Capital of France?", max_output_tokens=200
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == REASONING
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == REASONING
    # The reasoning item goes back in the next request's input, as clients send it.
    items = [{"role": "user", "content": "Capital of France?"}]
    items += [item.model_dump(exclude_none=True) for item in final.output]
    items += [
        {"type": "reasoning", "summary": [], "content": None},  # as Codex sends one
        {"role": "user", "content": "And Spain?"},
    ]
    again = client.responses.create(model="tiny", input=items, max_output_tokens=200)
    assert again.output_text == ANSWER


def test_anthropic_gives_thinking_blocks(thinker_url):
    import anthropic

    client = anthropic.Anthropic(base_url=thinker_url, api_key="x")
    whole = client.messages.create(
        model="tiny",
        max_tokens=900,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 600},
    )
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == REASONING and whole.content[1].text == ANSWER
    with client.messages.stream(model="tiny", max_tokens=900, messages=ASK) as stream:
        thinking = "".join(e.thinking for e in stream if e.type == "thinking")
        final = stream.get_final_message()
    assert thinking == REASONING
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].signature == ""
    # Thinking blocks (and redacted ones) sent back are taken, not refused.
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        {"role": "user", "content": "And Spain?"},
    ]
    history[1]["content"].insert(0, {"type": "redacted_thinking", "data": "opaque"})
    again = client.messages.create(
        model="tiny", max_tokens=200, messages=history, thinking={"type": "disabled"}
    )
    assert again.content[-1].text == ANSWER


def test_ollama_gives_thinking(thinker_url):
    import ollama

    client = ollama.Client(host=thinker_url)
    whole = client.chat(model="tiny", messages=ASK, think=True, options={"num_predict": 200})
    assert (whole.message.thinking, whole.message.content) == (REASONING, ANSWER)
    parts = list(client.chat(model="tiny", messages=ASK, stream=True, think="high"))
    assert "".join(p.message.thinking or "" for p in parts) == REASONING
    assert "".join(p.message.content for p in parts) == ANSWER
    generated = client.generate(model="tiny", prompt="Capital of France?", think=True)
    assert (generated.thinking, generated.response) == (REASONING, ANSWER)
    history = ASK + [
        {"role": "assistant", "content": ANSWER, "thinking": REASONING},
        {"role": "user", "content": "And Spain?"},
    ]
    assert client.chat(model="tiny", messages=history, think=False).message.content == ANSWER
    show = client.show("tiny")
    assert "thinking" in show.capabilities


def test_ollama_refuses_thinking_on_a_model_that_does_not(tiny_llama):
    engine = make_engine(load_model(tiny_llama, torch.float32), max_slots=1, kv_pool_tokens=2048)
    engine.start()
    running = start_server(create_app(engine, model_name="tiny"), "127.0.0.1", 0)
    try:
        body = {"model": "tiny", "messages": ASK, "think": True, "stream": False}
        refused = httpx.post(running.url + "/api/chat", json=body, timeout=30)
        assert refused.status_code == 400
        assert refused.json()["error"] == '"tiny" does not support thinking'
        body["think"] = False
        body["options"] = {"num_predict": 4}
        assert httpx.post(running.url + "/api/chat", json=body, timeout=30).status_code == 200
    finally:
        running.stop()
        engine.shutdown()
