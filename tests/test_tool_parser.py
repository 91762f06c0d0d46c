"""Tool-call formats: each family's parser on whole and cut text, and its grammar on text."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from lucedesk.chat import CallDelta, TextDelta, Tool, ToolChoice
from lucedesk.chat.formats import BY_NAME, format_of
from lucedesk.chat.messages import ChatMessage, ToolCall
from lucedesk.chat.tool_parser import parse_all
from lucedesk.engine.grammar import GrammarCompiler
from lucedesk.engine.models.loader import load_model

HERMES = (
    "Let me look that up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"}{\\" Nord", '
    '"days": [1, {"x": "]"}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA3 = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}'
)
CASES = [
    (
        "hermes",
        HERMES,
        "Let me look that up.",
        [
            ("get_weather", '{"city": "Paris \\"}{\\" Nord", "days": [1, {"x": "]"}]}'),
            ("get_time", "{}"),
        ],
    ),
    (
        "hermes",
        "plain text with < and <tool and <tool_cal",
        "plain text with < and <tool and <tool_cal",
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>',
        "",
        [("f", '{"a": 1}')],
    ),
    ("hermes", "<tool_call> not json", "<tool_call> not json", []),
    ("hermes", 'Done.\n<tool_call>\n{"nam', "Done.", []),
    (
        "hermes",
        'ok <tool_call>\n{"name": "f", "arguments": {"a": [1, 2',
        "ok",
        [("f", '{"a": [1, 2')],
    ),
    (
        "generic",
        '<tool_call>\n{"name": "f", "arguments": {"q": "日本語 🙂"}}\n</tool_call>',
        "",
        [("f", '{"q": "日本語 🙂"}')],
    ),
    ("llama3", LLAMA3, "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("llama3", "  The answer is {not a call}", "  The answer is {not a call}", []),
]


def events_text_and_args(events):
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallDelta):
            args[e.index] = args.get(e.index, "") + e.arguments
            if e.name is not None:
                assert e.index not in names, "a call's name is sent once"
                names[e.index] = e.name
    return text, [(names[i], args[i]) for i in sorted(args)]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_parser_whole_text(family, text, content, calls):
    got_content, got_calls = parse_all(BY_NAME[family].parser(), text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_parser_stream_cut_anywhere_gives_the_same(family, text, content, calls):
    cuts = [[i] for i in range(1, len(text))]
    rng = random.Random(0)
    cuts += [sorted(rng.sample(range(1, len(text)), 3)) for _ in range(30)]
    cuts.append(list(range(1, len(text))))  # one character at a time
    for points in cuts:
        parser = BY_NAME[family].parser()
        pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
        events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
        assert events_text_and_args(events) == (content, calls), points
        assert [(c.name, c.arguments) for c in parser.calls] == calls


def test_detect_family_from_template_text():
    assert format_of("{% if tools %}<tool_call>{{ tools }}{% endif %}").name == "hermes"
    assert format_of("{{ '<|python_tag|>' }}").name == "llama3"
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}").name == "generic"
    assert format_of(None).name == "generic"
    assert format_of("{{ '<|channel|>' }}<tool_call>").name == "harmony"  # tried first


def test_a_call_format_is_one_module_and_one_registry_entry(monkeypatch):
    from lucedesk.chat import formats
    from lucedesk.chat.formats.hermes import Hermes

    assert [f.name for f in formats.FORMATS] == ["harmony", "hermes", "llama3", "generic"]
    assert formats.reasoning_format("<tool_call>{{ '<think>' }}") == "think"
    assert formats.reasoning_format("<|channel|>") == "harmony"
    assert formats.reasoning_format("{{ m.content }}") is None

    class Bracketed(Hermes):  # a format of its own, as a new module would hold it
        name = "bracketed"

        def detects(self, template: str) -> bool:
            return "[[call" in template

    monkeypatch.setattr(formats, "FORMATS", (Bracketed(), *formats.FORMATS))
    assert format_of("{{ '[[call' }}").name == "bracketed"
    assert format_of("<tool_call>").name == "hermes"


def test_generic_format_describes_tools_and_renders_calls_and_results():
    tools = [Tool("get_weather", "Weather now", {"type": "object", "properties": {}})]
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    messages = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", tool_calls=[call]),
        ChatMessage("tool", "sunny", tool_call_id="call_1", name="get_weather"),
        ChatMessage("tool", "warm", tool_call_id="call_1", name="get_weather"),
    ]
    out, template_tools = BY_NAME["generic"].render_messages(messages, tools)
    assert template_tools == []
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou can call tools.")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert out[3]["content"] == (  # consecutive results: one user turn
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
    )


def test_native_format_hands_the_template_objects():
    call = ToolCall("call_1", "f", '{"a": 1}')
    out, template_tools = BY_NAME["hermes"].render_messages(
        [ChatMessage("assistant", tool_calls=[call])], [Tool("f")]
    )
    assert out[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert template_tools[0]["function"]["name"] == "f"


# -- grammars: what each accepts, fed the tiny model's own tokens -----------------------------

WEATHER = Tool(
    "get_weather",
    "",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
TIME = Tool("get_time", "", {"type": "object", "properties": {}, "additionalProperties": False})


@pytest.fixture(scope="module")
def compiler(tiny_llama):
    tok = load_model(tiny_llama).tokenizer
    return GrammarCompiler(tok, tok.vocab_size)


def accepts(compiler, grammar, text: str) -> bool:
    matcher = llguidance.LLMatcher(compiler.ll_tokenizer, compiler.check(grammar), log_level=0)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


def hermes_call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.parametrize("family", ["hermes", "generic"])
def test_marker_grammars(compiler, family):
    fmt, tools = BY_NAME[family], [WEATHER, TIME]
    auto = fmt.grammar(tools, ToolChoice("auto"))
    required = fmt.grammar(tools, ToolChoice("required"))
    named = fmt.grammar(tools, ToolChoice("function", "get_time"))
    single = fmt.grammar(tools, ToolChoice("required"), parallel=False)
    one = hermes_call("get_weather", {"city": "Paris"})
    two = one + "\n" + hermes_call("get_time", {})
    assert accepts(compiler, auto, "Just text, no call.")
    assert accepts(compiler, auto, "Checking.\n" + one)
    assert not accepts(compiler, auto, "Checking.\n<tool_call>\nnot json")
    assert not accepts(compiler, auto, hermes_call("get_weather", {"town": "Paris"}))
    assert accepts(compiler, required, two)
    assert not accepts(compiler, required, "Checking.\n" + one)
    assert accepts(compiler, single, one) and not accepts(compiler, single, two)
    assert accepts(compiler, named, hermes_call("get_time", {}))
    assert not accepts(compiler, named, one)


@pytest.fixture(scope="module")
def qwen_like(tiny_llama):
    """A vocabulary holding the markers as single (non-special) added tokens, as Qwen2.5 and
    Qwen3 do: llguidance then matches them as tokens, never as text."""
    from tokenizers import AddedToken

    from lucedesk.chat.formats.hermes import MARKERS

    tok = load_model(tiny_llama).tokenizer
    tok.backend.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    assert all(tok.token_to_id(m) is not None for m in MARKERS)
    return GrammarCompiler(tok, tok.vocab_size)


def test_marker_tokens_are_matched_as_tokens(qwen_like):
    from lucedesk.chat.formats.hermes import MARKERS

    fmt, tools, single = BY_NAME["hermes"], [WEATHER, TIME], frozenset(MARKERS)
    one = hermes_call("get_weather", {"city": "Paris"})
    thought = "<think>\nThe user wants weather.\n</think>\n\n"
    for choice in (ToolChoice("auto"), ToolChoice("required")):
        grammar = fmt.grammar(tools, choice, single_tokens=single)
        assert accepts(qwen_like, grammar, one)
        assert accepts(qwen_like, grammar, thought + one)
        assert accepts(qwen_like, grammar, one + "\n" + hermes_call("get_time", {}))
    auto = fmt.grammar(tools, ToolChoice("auto"), single_tokens=single)
    assert accepts(qwen_like, auto, "Sunny, I think.")
    assert accepts(qwen_like, auto, "Let me check. " + one)
    assert not accepts(qwen_like, auto, "<tool_call>\nnot json")


def test_tool_schemas_with_refs(compiler):
    """pydantic's schemas for nested models point into their own $defs."""
    nested = Tool(
        "locate",
        "",
        {
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Oslo"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"place": {"$ref": "#/$defs/Place"}},
            "required": ["place"],
            "additionalProperties": False,
        },
    )
    for fmt in (BY_NAME["hermes"], BY_NAME["llama3"]):
        grammar = fmt.grammar([TIME, nested], ToolChoice("required"))
        args = {"place": {"city": "Oslo"}}
        text = (
            hermes_call("locate", args)
            if fmt.name == "hermes"
            else json.dumps({"name": "locate", "parameters": args})
        )
        assert accepts(compiler, grammar, text)
        assert not accepts(compiler, grammar, text.replace("Oslo", "Rome"))


def test_llama3_grammar(compiler):
    fmt, tools = BY_NAME["llama3"], [WEATHER, TIME]
    call = json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})
    auto = fmt.grammar(tools, ToolChoice("auto"))
    assert accepts(compiler, auto, "It is sunny.")
    assert accepts(compiler, auto, call)
    assert accepts(compiler, auto, call + "; " + json.dumps({"name": "get_time", "parameters": {}}))
    assert not accepts(compiler, auto, '{"name": "nope", "parameters": {}}')
    assert not accepts(compiler, fmt.grammar(tools, ToolChoice("required")), "It is sunny.")
    # a brace after spaces opens a call too: free text cannot smuggle an unchecked one
    assert not accepts(compiler, auto, '  {"name": "zzz", "parameters": {}}')


def test_response_format_with_tools_constrains_the_answer_too(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = BY_NAME["hermes"].grammar([WEATHER], ToolChoice("auto"), text_schema=schema)
    assert accepts(compiler, grammar, '{"a": 3}')
    assert accepts(compiler, grammar, hermes_call("get_weather", {"city": "Oslo"}))
    assert not accepts(compiler, grammar, "free text")
    assert not accepts(compiler, grammar, '{\n\n   "a": 3}')  # no free whitespace


def test_only_offered_tools_are_calls():
    parser = BY_NAME["llama3"].parser(frozenset({"get_weather"}))
    content, calls = parse_all(parser, '{"name": "Alice", "parameters": {"age": 3}}')
    assert calls == [] and content == '{"name": "Alice", "parameters": {"age": 3}}'
    parser = BY_NAME["hermes"].parser(frozenset({"get_weather"}))
    content, calls = parse_all(parser, hermes_call("other", {}))
    assert calls == [] and "other" in content


def stream_through_guard(text: str, cut: int = 3):
    """A hermes reply fed `cut` characters at a time through the repeat guard: what goes out,
    the calls kept, and whether a repeat ended it."""
    from lucedesk.chat.repeated_calls import RepeatedCalls

    parser = BY_NAME["hermes"].parser()
    guard = RepeatedCalls(parser)
    out = []
    for i in range(0, len(text), cut):
        out += guard.filter(parser.feed(text[i : i + cut]))
        if guard.repeated:
            break
    else:
        out += guard.filter(parser.finish(False))
    return out, parser.calls, guard.repeated


def call_block(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>\n'


def test_a_repeated_call_is_dropped_and_ends_the_reply():
    a, b = (
        call_block("get_weather", '{"city": "Paris"}'),
        call_block("get_weather", '{"city": "Par"}'),
    )
    for cut in (1, 3, 7, 50):
        out, calls, repeated = stream_through_guard(a + b + a + b, cut)
        assert [c.arguments for c in calls] == ['{"city": "Paris"}', '{"city": "Par"}']
        assert repeated
        streamed: dict[int, str] = {}
        for d in out:
            if isinstance(d, CallDelta):
                streamed[d.index] = streamed.get(d.index, "") + d.arguments
        assert streamed == {0: '{"city": "Paris"}', 1: '{"city": "Par"}'}
        out, calls, repeated = stream_through_guard(a + b, cut)
        assert len(calls) == 2 and not repeated
    # spaced otherwise, the same arguments went out before they could be told apart: the
    # call stays, and the reply still ends there
    spaced = call_block("get_weather", '{"city":"Paris"}')
    _, calls, repeated = stream_through_guard(a + spaced + b)
    assert len(calls) == 2 and repeated


def test_a_call_that_differs_streams_as_soon_as_it_does():
    a = call_block("get_weather", '{"city": "Paris", "days": 3}')
    b = call_block("get_weather", '{"city": "Rome", "days": 3}')
    parser = BY_NAME["hermes"].parser()
    from lucedesk.chat.repeated_calls import RepeatedCalls

    guard = RepeatedCalls(parser)
    out = guard.filter(parser.feed(a))
    assert any(isinstance(d, CallDelta) for d in out)  # the first call is never held
    out = guard.filter(parser.feed(b[: b.index("Rome") + 1]))  # up to the R of Rome
    assert "".join(d.arguments for d in out if isinstance(d, CallDelta)) == '{"city": "R'
