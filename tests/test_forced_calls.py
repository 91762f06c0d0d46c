"""Forced tool calls through each protocol's official client, on the real default model: a
named choice yields one call; `required` / `any` never repeats an identical call in one
turn and ends with the protocol's tool finish reason; parallel calls turned off give one."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.test_protocols_default_model import ASK, CITY  # the same question and schema

pytestmark = pytest.mark.default_model

CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather now", "parameters": CITY},
}


@pytest.fixture(scope="module")
def oai(serve):
    return openai.OpenAI(base_url=serve + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(serve):
    return anthropic.Anthropic(base_url=serve, api_key="unused", max_retries=0)


def distinct(calls: list[tuple[str, str]]) -> bool:
    seen = [(name, json.dumps(json.loads(args), sort_keys=True)) for name, args in calls]
    return len(seen) == len(set(seen))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_required_never_repeats_a_call(oai, temperature):
    for seed in range(3):
        r = oai.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": ASK}],
            tools=[CHAT_TOOL],
            tool_choice="required",
            max_tokens=200,
            temperature=temperature,
            seed=seed,
        )
        choice = r.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls and distinct(calls), calls
        assert choice.finish_reason == "tool_calls"


def test_openai_named_choice_streams_one_call(oai):
    stream = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": ASK}],
        tools=[CHAT_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    ids, finish = set(), None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id:
                ids.add(delta.id)
        finish = chunk.choices[0].finish_reason or finish
    assert len(ids) == 1
    assert finish == "tool_calls"


def test_openai_parallel_calls_off_gives_one(oai):
    r = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": ASK}],
        tools=[CHAT_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    assert len(r.choices[0].message.tool_calls) == 1
    assert r.choices[0].finish_reason == "tool_calls"


def test_anthropic_any_never_repeats_and_disabling_parallel_gives_one(claude):
    """Sampled: this client sends no temperature."""
    tools = [{"name": "get_weather", "description": "The weather now", "input_schema": CITY}]
    for disable in (False, False, False, True):
        m = claude.messages.create(
            model="default",
            max_tokens=200,
            tools=tools,
            tool_choice={"type": "any", "disable_parallel_tool_use": disable},
            messages=[{"role": "user", "content": ASK}],
        )
        uses = [(b.name, json.dumps(b.input)) for b in m.content if b.type == "tool_use"]
        assert uses and distinct(uses), uses
        if disable:
            assert len(uses) == 1
        # Sampled, a model may go on with distinct calls (other cities) until max_tokens;
        # what it never does is repeat one, or end otherwise. One call: the tool's end.
        assert m.stop_reason == "tool_use" or (m.stop_reason == "max_tokens" and not disable)
    named = claude.messages.create(
        model="default",
        max_tokens=200,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": ASK}],
    )
    assert [b.type for b in named.content if b.type == "tool_use"] == ["tool_use"]
    assert named.stop_reason == "tool_use"


def test_responses_required_never_repeats_a_call(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "x", "parameters": CITY}]
    events = list(
        oai.responses.create(
            model="default",
            input=ASK,
            tools=tools,
            tool_choice="required",
            max_output_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    done = next(e for e in events if e.type == "response.completed").response
    calls = [(i.name, i.arguments) for i in done.output if i.type == "function_call"]
    assert calls and distinct(calls), calls
    assert done.status == "completed"
