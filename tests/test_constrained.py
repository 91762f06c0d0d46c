"""Constrained decoding in the engine: outputs match their grammar, batching changes no
token of a constrained row (fp32, preemption mid-grammar included), bad grammars fail alone."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import jsonschema
import pytest
import torch

from lucedesk.chat import ChatEncoder, Tool, ToolChoice, schema_grammar
from lucedesk.engine import FinishReason, Grammar, RequestError, SamplingParams
from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import Request
from lucedesk.engine.sampler import Sampler
from tests.engine_harness import Job, make_engine, random_jobs, run_alone, run_jobs

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
# Long enough that the three pressure requests are mid-grammar when the pool runs out.
LONG = r"[a-z ]{300}\."


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load_model(tiny_llama, torch.float32)


def constrain(jobs: list[Job], seed: int) -> list[Job]:
    rng = random.Random(seed)
    out = []
    for i, job in enumerate(jobs):
        if i < 3:
            grammar = Grammar.regex(LONG)
        else:
            grammar = rng.choice([None, schema_grammar(SCHEMA), Grammar.regex(REGEX)])
        out.append(replace(job, params=replace(job.params, grammar=grammar)))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_constrained_rows_batched_equal_alone_with_preemption(loaded, seed):
    jobs = constrain(random_jobs(loaded, 12, seed=seed, output_range=(16, 64)), seed)
    engine = make_engine(
        loaded,
        max_slots=4,
        kv_pool_tokens=23 * 16,
        max_num_batched_tokens=48,
        prefill_chunk_idle=32,
        prefill_chunk_decoding=16,
    )
    batched = run_jobs(engine, jobs)
    assert engine.scheduler.num_preemptions > 0
    assert batched == run_alone(loaded, jobs)
    tokenizer = loaded.tokenizer
    for job, tokens in zip(jobs, batched):
        grammar = job.params.grammar
        text = tokenizer.decode(tokens)
        if grammar is None or len(tokens) == job.params.max_tokens:
            continue  # cut by max_tokens: nothing to check whole
        if grammar.kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            import re

            assert re.fullmatch(grammar.source, text), text


def test_grammar_ends_the_request_even_with_ignore_eos(loaded):
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=2048)
    prompt = loaded.tokenizer.encode("Numbers: 0 1 2")
    params = SamplingParams(
        max_tokens=50, temperature=0, ignore_eos=True, grammar=Grammar.regex(REGEX)
    )
    handle = engine.submit(prompt, params)
    while not handle.finished:
        engine.step()
    done = handle.result(timeout=0)
    assert done.finish_reason is FinishReason.STOP
    import re

    assert re.fullmatch(REGEX, done.text)
    engine.scheduler.check_integrity()
    assert engine.scheduler.pool.num_used_blocks == 0


def test_sampled_rows_follow_the_grammar(loaded):
    engine = make_engine(loaded, max_slots=4, kv_pool_tokens=4096).start()
    try:
        prompt = loaded.tokenizer.encode("The quick brown fox")
        handles = [
            engine.submit(
                prompt,
                SamplingParams(
                    max_tokens=60, temperature=1.0, seed=i, grammar=schema_grammar(SCHEMA)
                ),
            )
            for i in range(4)
        ]
        for h in handles:
            done = h.result(timeout=60)
            assert done.finish_reason is FinishReason.STOP
            jsonschema.validate(json.loads(done.text), SCHEMA)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("grammar", "field"),
    [
        (schema_grammar({"type": "nope"}, "response_format"), "response_format"),
        (Grammar.regex("a((", "grammar"), "grammar"),
        (Grammar.lark("start: undefined_rule", "grammar"), "grammar"),
    ],
)
def test_bad_grammar_is_refused_at_submit_naming_its_field(loaded, grammar, field):
    engine = make_engine(loaded, max_slots=1, kv_pool_tokens=1024)
    with pytest.raises(RequestError) as err:
        engine.submit([5, 6, 7], SamplingParams(max_tokens=4, grammar=grammar))
    assert err.value.field == field
    assert not engine.scheduler.waiting and not engine._inbox


def test_encode_chat_names_the_bad_tool(loaded):
    engine = make_engine(loaded, max_slots=1, kv_pool_tokens=1024)
    good = Tool("a", "", {"type": "object"})
    bad = Tool("b", "", {"type": "object", "properties": {"x": {"type": "nope"}}})
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError) as err:
        ChatEncoder.of(engine).encode(messages, [good, bad])
    assert err.value.field == "tools[1]"
    with pytest.raises(RequestError) as err:
        ChatEncoder.of(engine).encode(messages, [good], ToolChoice("function", "zzz"))
    assert err.value.field == "tool_choice"
    with pytest.raises(RequestError) as err:
        ChatEncoder.of(engine).encode(messages, [], ToolChoice("required"))
    assert err.value.field == "tool_choice"
    prompt = ChatEncoder.of(engine).encode(messages, [good], ToolChoice("none"))
    assert prompt.grammar is None and prompt.parser() is None


def test_a_dead_end_grammar_fails_its_row_alone(loaded):
    """A grammar whose only next token lies outside the logits fails that row; the batch's
    other rows are sampled as usual."""
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=1024)
    vocab = loaded.tokenizer.vocab_size
    stuck = Request("stuck", [1], SamplingParams(max_tokens=2, temperature=0))
    stuck.matcher = engine.grammars.matcher(Grammar.lark(f"start: <[{vocab - 1}]>"))
    free = Request("free", [1], SamplingParams(max_tokens=2, temperature=0))
    stuck.slot, free.slot = 0, 1
    logits = torch.randn(2, vocab - 1)  # the one token the grammar allows is not among these
    result = Sampler().sample(logits, [stuck, free])
    assert result.errors == {0: "the grammar allows no next token"}
    assert result.sampled == {1: int(logits[1].argmax())}


def test_logprobs_are_the_models_distribution(loaded):
    engine = make_engine(loaded, max_slots=1, kv_pool_tokens=1024)
    req = Request("r", [1], SamplingParams(max_tokens=2, temperature=0, logprobs=3))
    req.slot = 0
    logits = torch.randn(1, 50)
    result = Sampler().sample(logits.clone(), [req])
    lp = result.logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert lp.token_id == int(expected.argmax()) == result.sampled[0]
    assert lp.logprob == pytest.approx(float(expected.max()))
    top = torch.topk(expected, 3)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist())
    del engine


def test_ignore_eos_keeps_a_grammar_that_may_end_going(loaded):
    """`[a-z ]*` may end after any letter; with ignore_eos it runs to max_tokens, and a
    grammar that must end still ends the request."""
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=2048)
    prompt = loaded.tokenizer.encode("The quick brown fox")
    may_end = SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, grammar=Grammar.regex("[a-z ]*")
    )
    must_end = SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, grammar=Grammar.regex("ab")
    )
    handles = [engine.submit(prompt, may_end), engine.submit(prompt, must_end)]
    while not all(h.finished for h in handles):
        engine.step()
    long, short = (h.result(timeout=0) for h in handles)
    assert long.finish_reason is FinishReason.LENGTH and long.num_output_tokens == 20
    assert short.finish_reason is FinishReason.STOP and short.text == "ab"
