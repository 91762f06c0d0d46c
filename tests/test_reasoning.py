"""Reasoning apart from the answer: Qwen3-style <think> tags and gpt-oss's harmony channels,
read from a reply streamed in any cut (every byte) into the same reasoning, answer and
calls; harmony's tool grammar against real transcripts; and both through the engine on
tiny models whose replies are scripted."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from lucedesk.chat import ChatEncoder, Sampling, Tool, ToolChoice, TurnRequest, submit_turn
from lucedesk.chat.formats import BY_NAME
from lucedesk.chat.formats.harmony import HarmonyParser
from lucedesk.chat.reasoning import ThinkSplitter
from lucedesk.chat.tool_parser import CallDelta, ReasoningDelta, TextDelta
from lucedesk.engine.models.loader import load_model
from tests.conftest import write_tiny_model
from tests.engine_harness import make_engine, script_replies

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)

THINK_REPLIES = [
    ("<think>\nThe user asks for a capital.\nParis.  \n</think>\n\nParis.", False),
    ("  <think>a</think>b", False),
    ("no reasoning at all <think>x</think>", False),
    ("<think>cut off while thinking  ", False),
    ("<thi", False),
    ("already inside\n</think>\n\nthe answer", True),
    (
        '<think>\nneed weather\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>',
        False,
    ),
]

# harmony pieces: the next message, a call's header (recipient in the channel, in the role)
NEXT = "<|end|><|start|>assistant"
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
ROLE_CALL = " to=functions.get_weather<|channel|>commentary json<|message|>"

HARMONY_REPLIES = [
    "<|channel|>analysis<|message|>Simple arithmetic.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
    "<|channel|>analysis<|message|>Need the weather." + NEXT + CALL + '{"city": "Paris"}',
    "<|channel|>analysis<|message|>x<|end|><|start|>assistant" + ROLE_CALL + '{"city":"Oslo"}',
    "<|channel|>commentary<|message|>Checking now."
    + NEXT
    + CALL.replace(" <|c", "<|c")
    + '{"city": "R',
    "<|channel|>final<|message|>just an answer, <|end with a bar",
    "<|channel|>analysis<|message|>thinking until the tokens ran o",
    '<|channel|>commentary to=functions.unknown_tool <|constrain|>json<|message|>{"a": 1}',
    "<|channel|>commentary<|message|>Checking." + NEXT + "<|channel|>final<|message|>Sunny.",
    "a reply that never wrote a header",
]


def split(parser, text: str, cuts: list[int]) -> tuple[str, str, list]:
    events, at = [], 0
    for cut in cuts:
        events += parser.feed(text[at:cut])
        at = cut
    events += parser.feed(text[at:]) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    answer = "".join(e.text for e in events if isinstance(e, TextDelta))
    streamed: dict[int, list] = {}
    for e in events:
        if isinstance(e, CallDelta):
            streamed.setdefault(e.index, [e.name, ""])[1] += e.arguments
    calls = [(c.name, c.arguments) for c in parser.calls]
    assert [tuple(v) for _, v in sorted(streamed.items())] == calls  # streamed == whole
    return reasoning, answer, calls


def every_cut(make, text: str):
    whole = split(make(), text, [])
    for cut in range(len(text) + 1):
        assert split(make(), text, [cut]) == whole, (text, cut)
    rng = random.Random(len(text))
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 6)))
        assert split(make(), text, cuts) == whole, (text, cuts)
    return whole


@pytest.mark.parametrize("text,inside", THINK_REPLIES)
def test_think_tags_split_the_same_in_any_cut(text, inside):
    tools = frozenset({"get_weather"})
    reasoning, answer, calls = every_cut(
        lambda: ThinkSplitter(BY_NAME["hermes"].parser(tools), inside), text
    )
    plain = every_cut(lambda: ThinkSplitter(None, inside), text)
    if not calls:
        assert plain == (reasoning, answer, calls)
    if text.startswith("<think>\nThe user"):
        assert (reasoning, answer) == ("The user asks for a capital.\nParis.", "Paris.")
    if inside:
        assert (reasoning, answer) == ("already inside", "the answer")
    if "tool_call" in text:
        assert reasoning == "need weather" and calls == [("get_weather", '{"city": "Paris"}')]
    if text.startswith("no reasoning"):
        assert reasoning == "" and answer == text


@pytest.mark.parametrize("text", HARMONY_REPLIES)
def test_harmony_channels_split_the_same_in_any_cut(text):
    reasoning, answer, calls = every_cut(lambda: HarmonyParser(frozenset({"get_weather"})), text)
    if "final<|message|>2 + 2" in text:
        assert (reasoning, answer, calls) == ("Simple arithmetic.", "2 + 2 = 4.", [])
    if "Need the weather" in text:
        assert reasoning == "Need the weather."
        assert calls == [("get_weather", '{"city": "Paris"}')] and answer == ""
    if "Oslo" in text:  # the recipient in the role
        assert calls == [("get_weather", '{"city":"Oslo"}')]
    if "Checking now" in text:  # a preamble is answer text; the cut call is still a call
        assert answer == "Checking now." and calls == [("get_weather", '{"city": "R')]
    if "ran o" in text:
        assert reasoning.endswith("ran o") and not answer
    if "unknown_tool" in text:  # a call to a tool never offered stays text
        assert not calls and answer == '{"a": 1}'
    if "<|end with" in text:  # text that only starts like a marker is text
        assert answer == "just an answer, <|end with a bar"
    if "Sunny" in text:  # a preamble and the final answer: two paragraphs
        assert answer == "Checking.\n\nSunny." and not reasoning
    if "never wrote" in text:  # without a grammar nothing forces a header: kept as text
        assert answer == text


def test_a_harmony_call_cut_short_is_marked_incomplete():
    parser = HarmonyParser(frozenset({"get_weather"}))
    parser.feed('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"ci')
    parser.finish()
    assert parser.incomplete
    whole = HarmonyParser(frozenset({"get_weather"}))
    whole.feed('<|channel|>commentary to=functions.get_weather<|message|>{"city": "x"}')
    whole.finish()
    assert not whole.incomplete and whole.calls[0].arguments == '{"city": "x"}'


# -- through the engine, on tiny models whose replies are scripted --------------------------

QWEN3_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content and loop.last %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def thinking_checkpoint(folder):
    """A tiny Qwen3 whose chat template thinks in tags (and takes enable_thinking)."""
    write_tiny_model(folder, "qwen3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return load_model(thinking_checkpoint(tmp_path_factory.mktemp("thinker")), torch.float32)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony")
    return load_model(write_tiny_model(folder, "gpt-oss", harmony=True), torch.float32)


def run_turn(engine, req: TurnRequest):
    async def go():
        return await submit_turn(engine, req, "test").collect()

    return asyncio.run(asyncio.wait_for(go(), 60))


@pytest.fixture
def running():
    """make(loaded, **config) -> a started engine, shut down after the test."""
    engines = []

    def make(loaded, **config):
        engines.append(make_engine(loaded, **config).start())
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def test_a_thinking_models_reasoning_comes_apart(thinker, running):
    engine = running(thinker, max_slots=2, kv_pool_tokens=4096)
    script_replies(engine, lambda ids: "<think>\nIt is Paris.\n</think>\n\nParis.")
    messages = [{"role": "user", "content": "Capital of France?"}]
    done = run_turn(engine, TurnRequest(messages, sampling=Sampling(max_tokens=64)))
    assert (done.reasoning, done.text, done.finish) == ("It is Paris.", "Paris.", "stop")
    # "none" turns thinking off in the template: the prompt closes an empty block
    prompt = ChatEncoder.of(engine).encode(messages, reasoning="none")
    assert thinker.tokenizer.decode(prompt.token_ids).endswith("<think>\n\n</think>\n\n")
    on = ChatEncoder.of(engine).encode(messages, reasoning="high")
    assert not thinker.tokenizer.decode(on.token_ids).endswith("</think>\n\n")
    # earlier reasoning reaches the template as reasoning_content
    history = messages + [{"role": "assistant", "content": "Paris.", "reasoning": "Easy."}]
    text = thinker.tokenizer.decode(ChatEncoder.of(engine).encode(history).token_ids)
    assert "<think>\nEasy.\n</think>\n\nParis." in text


def test_harmony_replies_through_the_engine(harmony, running):
    tok = harmony.tokenizer
    assert tok.token_to_id("<|end|>") not in tok.stop_token_ids
    assert {tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")} <= set(tok.stop_token_ids)
    engine = running(harmony, max_slots=2, kv_pool_tokens=4096)
    replies = {
        "weather": "<|channel|>analysis<|message|>Use the tool."
        + NEXT
        + CALL
        + '{"city": "Oslo"}<|call|>',
        "hello": "<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello!<|return|>",
    }
    script_replies(
        engine, lambda ids: replies["weather" if "weather" in tok.decode(ids) else "hello"]
    )
    hello = run_turn(
        engine,
        TurnRequest([{"role": "user", "content": "hello"}], sampling=Sampling(max_tokens=64)),
    )
    assert (hello.reasoning, hello.text, hello.calls) == ("Greet back.", "Hello!", [])
    ask = [{"role": "user", "content": "weather in Oslo?"}]
    call = run_turn(engine, TurnRequest(ask, tools=[WEATHER], sampling=Sampling(max_tokens=400)))
    assert call.reasoning == "Use the tool." and call.finish == "tool_calls"
    assert [(c.name, c.arguments) for c in call.calls] == [("get_weather", '{"city": "Oslo"}')]
    # The prompt: the tool as the template writes it, the reasoning level asked for.
    prompt = tok.decode(
        ChatEncoder.of(engine).encode(ask, [WEATHER], reasoning="high").token_ids, False
    )
    assert "Reasoning: high" in prompt and "type get_weather = (_: {" in prompt
    assert prompt.endswith("<|start|>assistant")
    # The call and its result go back as the template renders a tool loop.
    history = ask + [
        {"role": "assistant", "content": None, "tool_calls": call.calls, "reasoning": "Use it."},
        {"role": "tool", "tool_call_id": call.calls[0].id, "name": "get_weather", "content": "9C"},
    ]
    text = tok.decode(ChatEncoder.of(engine).encode(history, [WEATHER]).token_ids, False)
    assert "<|channel|>analysis<|message|>Use it.<|end|>" in text
    assert "<|start|>assistant" + ROLE_CALL + '{"city": "Oslo"}<|call|>' in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in text


def grammar_accepts(engine, grammar, text: str) -> bool:
    matcher = engine.grammars.matcher(grammar)
    for token in engine.tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return True


def test_harmony_grammar_holds_calls_to_one_form(harmony):
    engine = make_engine(harmony, max_slots=1, kv_pool_tokens=1024)
    ask = [{"role": "user", "content": "weather?"}]
    required = ChatEncoder.of(engine).encode(ask, [WEATHER], ToolChoice("required")).grammar
    auto = ChatEncoder.of(engine).encode(ask, [WEATHER]).grammar
    call = CALL + '{"city": "Oslo"}'
    thought = "<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>It is sunny."
    assert grammar_accepts(engine, required, call)
    assert grammar_accepts(engine, required, thought + call)
    assert not grammar_accepts(engine, required, thought + final)
    assert grammar_accepts(engine, auto, thought + final)
    assert grammar_accepts(engine, auto, thought + call)
    bad_args = (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town": 1}'
    )
    assert not grammar_accepts(engine, auto, bad_args)
    assert not grammar_accepts(engine, auto, "no channel at all")


async def test_an_agent_keeps_its_reasoning_apart(thinker, tmp_path):
    """An agent on the engine: the reply's reasoning is stored beside its text (not in it),
    and goes back to the template with the conversation on the next turn."""
    from lucedesk.agent import AgentSession, EngineBackend, Runtime
    from lucedesk.store import Store

    engine = make_engine(thinker, max_slots=2, kv_pool_tokens=4096).start()
    prompts: list[str] = []

    def reply(ids):
        prompts.append(thinker.tokenizer.decode(ids))
        return "<think>\nIt is Paris.\n</think>\n\nParis."

    script_replies(engine, reply)
    store = Store(tmp_path / "sessions.db")
    try:
        record = store.create_session("chat", max_tokens=64)
        session = AgentSession(Runtime(EngineBackend(lambda: engine), store), record)
        assert (await session.send("Capital of France?")).text == "Paris."
        stored = store.session(record.id).messages[-1]
        assert stored.content == "Paris." and stored.meta()["reasoning"] == "It is Paris."
        await session.send("And of Spain?")
    finally:
        store.close()
        engine.shutdown()
    assert "<think>" not in prompts[0]
    history = record.chat_messages()
    assert [m.reasoning for m in history] == ["", "It is Paris.", "", "It is Paris."]
    # This template shows the reasoning of the last reply only: the earlier one is left out.
    assert "<think>\nIt is Paris.\n</think>" not in prompts[1]
    last_turn = thinker.tokenizer.decode(ChatEncoder.of(engine).encode(history).token_ids)
    assert "<think>\nIt is Paris.\n</think>\n\nParis." in last_turn
