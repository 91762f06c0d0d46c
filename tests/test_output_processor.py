"""Output processing on token lists: incremental text, stop strings, end tokens, logprobs,
the last delta. No model and no thread: a tokenizer and the scheduler's two calls."""

from __future__ import annotations

import pytest

from lucedesk.engine.handle import RequestHandle, RequestOutput, TokenLogprob
from lucedesk.engine.models.tokenizer import Tokenizer, from_hf_folder
from lucedesk.engine.output import OutputProcessor
from lucedesk.engine.request import FinishReason, Request, SamplingParams
from tests.conftest import write_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder)
    return from_hf_folder(folder)


class Steps:
    """Scheduler.update and Scheduler.finish for token lists: each step appends tokens to
    the request, finishing it at an end token or at max_tokens, then the engine streams
    them and closes what finished."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.outputs = OutputProcessor(tokenizer, self.finish)
        self.stop_token_ids = frozenset(tokenizer.stop_token_ids)
        self.recently_finished: list[str] = []

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        if not req.finished:
            req.finish_reason, req.error = reason, error
            self.recently_finished.append(req.request_id)

    def open(self, prompt_ids: list[int], **params) -> tuple[Request, RequestHandle]:
        req = Request("r", prompt_ids, SamplingParams(**params), stop_ids=self.stop_token_ids)
        handle = RequestHandle(req.request_id, len(prompt_ids), lambda rid: None)
        self.outputs.add(req, handle)
        return req, handle

    def step(
        self, req: Request, tokens: list[int], logprobs: dict[str, TokenLogprob] | None = None
    ) -> list[Request]:
        produced = []
        for t in tokens:
            req.output_ids.append(t)
            produced.append(req)
            if t in req.stop_ids:
                self.finish(req, FinishReason.STOP)
            elif req.num_output_tokens >= req.params.max_tokens:
                self.finish(req, FinishReason.LENGTH)
            if req.finished:
                break
        counted = self.outputs.process(produced, logprobs)
        for rid in self.recently_finished:
            self.outputs.close(rid)
        self.recently_finished.clear()
        return counted


def texts(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_incremental_text_is_the_whole_decode(tokenizer):
    text = "café 日本語 🙂🚀 naïve\n  def f(): return 42"
    ids = tokenizer.encode(text, add_special_tokens=False)
    end = tokenizer.stop_token_ids[0]
    steps = Steps(tokenizer)
    req, handle = steps.open(tokenizer.encode("Paris is"), max_tokens=100)
    sizes = [1, 3, 2, 1, 4]  # drafts give several tokens in one step
    at = 0
    while at < len(ids):
        n = sizes[at % len(sizes)]
        steps.step(req, ids[at : at + n])
        at += n
    steps.step(req, [end])
    outputs = handle.take_ready()
    assert texts(outputs) == text == tokenizer.decode(ids)
    assert not any("\ufffd" in o.text for o in outputs)  # never half a character
    assert [t for o in outputs for t in o.token_ids] == [*ids, end]  # the end token counts
    final = outputs[-1]
    assert final.finished and final.finish_reason is FinishReason.STOP
    assert final.num_output_tokens == len(ids) + 1 and final.stop_sequence is None
    assert steps.outputs.get("r") is None  # closed and forgotten


def test_length_finish_flushes_the_text(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    steps = Steps(tokenizer)
    req, handle = steps.open([5, 6], max_tokens=len(ids))
    for t in ids:
        steps.step(req, [t])
    done = handle.result(timeout=0)
    assert done.text == TEXT and done.finish_reason is FinishReason.LENGTH


def test_stop_string_cuts_the_text_and_finishes(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    steps = Steps(tokenizer)
    req, handle = steps.open([5, 6], max_tokens=100, stop=("fox",))
    for t in ids:
        if req.finished:
            break
        steps.step(req, [t])
    done = handle.result(timeout=0)
    assert done.finish_reason is FinishReason.STOP
    assert done.text == TEXT[: TEXT.index("fox")]
    assert "fox" not in done.text
    assert handle.take_ready()[-1].stop_sequence == "fox"
    assert tokenizer.decode(done.token_ids).startswith(TEXT[: TEXT.index("fox") + 1])


def test_tokens_drafted_after_a_stop_string_are_dropped(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    steps = Steps(tokenizer)
    req, handle = steps.open([5, 6], max_tokens=100, stop=(" quick",))
    counted = steps.step(req, ids)  # one step with every token, as a long draft
    done = handle.result(timeout=0)
    assert done.text == "The" and done.finish_reason is FinishReason.STOP
    assert len(counted) == len(done.token_ids) == req.num_output_tokens < len(ids)
    assert tokenizer.decode(done.token_ids) == "The quick"


def test_stop_string_split_across_two_steps_is_held_back_then_found(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    first = pieces.index(" b")  # " brow" is " b" + "row": two tokens, two steps
    assert pieces[first + 1] == "row"
    steps = Steps(tokenizer)
    req, handle = steps.open([5, 6], max_tokens=100, stop=(" brow",))
    steps.step(req, ids[: first + 1])
    sent = texts(handle.take_ready())
    assert sent == "The quick"  # " b" could still grow into the stop string: held back
    assert not req.finished
    steps.step(req, [ids[first + 1]])
    last = handle.take_ready()
    assert texts(last) == "" and last[-1].finished
    assert last[-1].finish_reason is FinishReason.STOP and last[-1].stop_sequence == " brow"
    assert handle.result(timeout=0).text == "The quick"


def test_a_held_tail_that_is_not_a_stop_string_is_sent(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    first = pieces.index(" b")
    steps = Steps(tokenizer)
    req, handle = steps.open([5, 6], max_tokens=100, stop=(" bx",))
    steps.step(req, ids[: first + 1])
    assert texts(handle.take_ready()) == "The quick"
    steps.step(req, [ids[first + 1]])
    assert texts(handle.take_ready()) == " brow"


def test_logprobs_travel_with_their_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:4]
    steps = Steps(tokenizer)
    req, handle = steps.open([5, 6], max_tokens=4, logprobs=1)
    for i, t in enumerate(ids):
        steps.step(req, [t], {"r": TokenLogprob(t, -float(i), ((t, -float(i)),))})
    done = handle.result(timeout=0)
    assert [lp.token_id for lp in done.logprobs] == done.token_ids == ids
    assert [lp.logprob for lp in done.logprobs] == [0.0, -1.0, -2.0, -3.0]


def test_a_failure_finishes_only_that_request(tokenizer):
    steps = Steps(tokenizer)
    good, good_handle = steps.open([5, 6], max_tokens=3)
    bad = Request("bad", [5, 6], SamplingParams(max_tokens=3))
    bad_handle = RequestHandle("bad", 2, lambda rid: None)
    steps.outputs.add(bad, bad_handle)
    bad.output_ids.append(-1)  # no such token: detokenizing it raises
    good.output_ids.append(tokenizer.encode("The")[0])  # "Th"
    counted = steps.outputs.process([bad, good])
    assert counted == [bad, good]
    assert bad.finish_reason is FinishReason.ERROR
    assert bad.error.startswith("output processing failed")
    assert not good.finished and texts(good_handle.take_ready()) == "Th"
