"""Sessions that never dead-end, on a model with a 1,024-token context: the agent loop
measures each turn with the model's own tokenizer and template (the in-process engine's
measures), compacts the older messages into a summary the model writes, cuts tool results
too large for the room left, shortens a child's report too long for its parent, and refuses
a message that can never fit without storing it. The model's replies are scripted (the
summaries too); every turn still runs a real engine request."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from lucedesk.agent import (
    AgentSession,
    Approvals,
    EngineBackend,
    Limits,
    Runtime,
    Workspace,
    run_to_answer,
)
from lucedesk.agent.compactor import SHORTEN, SUMMARIZER
from lucedesk.agent.tools import BUILTIN
from lucedesk.chat import TurnRequest
from lucedesk.engine.models.loader import load_model
from lucedesk.store import Store
from tests.conftest import write_tiny_model
from tests.engine_harness import make_engine
from tests.test_agent_loop import (  # noqa: F401  (fixtures)
    Reply,
    ScriptedBackend,
    call,
    engine,
    loaded,
    results,
    task,
    ws,
)

WORDS = "river stone lamp orange quiet garden metal cloud paper window seven bright".split()


@dataclass
class MeasuredBackend(ScriptedBackend):
    """Scripted replies; the context and every count from the engine, as EngineBackend has
    them."""

    def __post_init__(self) -> None:
        self.measures = EngineBackend(lambda: self.engine)
        self.prompts: list[tuple[str, int]] = []  # (kind, prompt tokens) of each turn

    async def context_limit(self) -> int | None:
        return await self.measures.context_limit()

    def count(self, texts) -> list[int]:
        return self.measures.count(texts)

    def prompt_tokens(self, req: TurnRequest) -> int:
        return self.measures.prompt_tokens(req)

    async def turn(self, req, owner, on_text, on_reasoning):
        self.prompts.append((kind_of(req), self.prompt_tokens(req)))
        return await super().turn(req, owner, on_text, on_reasoning)


def kind_of(req: TurnRequest) -> str:
    system = req.messages[0].content if req.messages[0].role == "system" else ""
    if system == SUMMARIZER:
        shorten = req.messages[-1].content.startswith(SHORTEN.split("{", 1)[0][:40])
        return "shorten" if shorten else "summary"
    return "turn"


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def answer(req: TurnRequest) -> Reply:
    kind = kind_of(req)
    if kind == "summary":
        return Reply("notes: the user listed words; the assistant agreed.")
    if kind == "shorten":
        return Reply("short report: part found")
    return Reply("noted")


@pytest.fixture(scope="module")
def agent_engine(tmp_path_factory):
    """A model whose tokenizer learned the tools' definitions (a random one spends a token
    on about every character) and has 8,192 positions: an agent with every tool fits."""
    tools = " ".join(f"{t.name} {t.description} {t.parameters}" for t in BUILTIN)
    folder = tmp_path_factory.mktemp("agent_model")
    path = write_tiny_model(folder, "llama", context=8192, corpus=tools + " ".join(WORDS) * 20)
    wide = make_engine(load_model(path, torch.float32), kernels="torch", kv_pool_tokens=8192)
    yield wide.start()
    wide.shutdown()


def harness_for(engine, tmp_path):  # noqa: F811
    store = Store(tmp_path / "sessions.db")
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")

    def build(script, limits: Limits | None = None) -> tuple[MeasuredBackend, Runtime]:
        backend = MeasuredBackend(engine, ids, script)
        return backend, Runtime(backend, store, Approvals(), limits=limits or Limits())

    return build, store


@pytest.fixture
def harness(engine, tmp_path):  # noqa: F811
    build, store = harness_for(engine, tmp_path)
    yield build, store
    store.close()


@pytest.fixture
def agents(agent_engine, tmp_path):
    build, store = harness_for(agent_engine, tmp_path)
    yield build, store
    store.close()


async def test_a_chat_of_twelve_long_messages_is_answered_every_time(harness, engine):  # noqa: F811
    build, store = harness
    backend, runtime = build(answer)
    limit = engine.max_request_tokens
    assert limit == 1024
    record = store.create_session("long chat", temperature=0.0, max_tokens=32)
    session = AgentSession(runtime, record)
    rng = random.Random(3)
    for i in range(12):
        text = f"message {i}: " + prose(rng, 54)
        assert 200 <= backend.count([text])[0] <= 300
        result = await session.send(text)
        assert result.status == "done", result.error
    turns = [n for kind, n in backend.prompts if kind == "turn"]
    assert len(turns) == 12
    assert max(turns) <= 0.8 * limit + backend.count([text])[0]  # compacted before passing
    assert all(n + 32 <= limit for n in turns)  # and the reply always had its room
    # The store keeps every message; the compactions are marked among them.
    record = store.session(record.id)
    spoken = [m for m in record.messages if m.role != "compaction"]
    assert [m.role for m in spoken] == ["user", "assistant"] * 12
    markers = [m for m in record.messages if m.role == "compaction"]
    assert len(markers) >= 2
    assert all(m.compacted >= 2 and m.tokens > 0 and m.content.startswith("notes") for m in markers)
    # The model reads the last summary in place of what it covers, then the recent turns whole.
    view = session.model_messages()
    assert view[0].role == "system" and "notes: the user listed words" in view[0].content
    assert view[1].role == "user" and view[-1].content == "noted"
    assert len(view) < 24


async def test_a_headless_agent_whose_tool_results_pass_its_context_finishes(agents, ws):  # noqa: F811
    rng = random.Random(5)
    (ws / "big.log").write_text("".join(f"{i}: {prose(rng, 12)}\n" for i in range(3000)))
    reads = [4]  # read calls left to make

    def script(req: TurnRequest) -> Reply:
        if kind_of(req) != "turn":
            return answer(req)
        if reads[0]:
            reads[0] -= 1
            return Reply(calls=(call("read_file", {"path": "big.log"}),))
        return Reply("the log is long")

    build, store = agents
    backend, runtime = build(script, Limits(max_steps=12))
    answer_ = await run_to_answer(
        runtime.backend,
        store,
        Workspace(ws),
        "Read big.log until you know it.",
        approvals=Approvals(),
        limits=Limits(max_steps=12),
        max_tokens=32,
    )
    assert answer_.status == "done", answer_.error
    assert answer_.text == "the log is long"
    limit = await backend.context_limit()
    turns = [n for kind, n in backend.prompts if kind == "turn"]
    assert len(turns) >= 2 and all(n + 32 <= limit for n in turns)
    kinds = [kind for kind, _ in backend.prompts]
    assert "summary" in kinds and sum(turns) > limit  # the results together passed it
    # Each result was cut in the model's view (the store keeps it whole).
    stored = [m for m in store.session(answer_.session.id).messages if m.role == "tool"]
    assert stored and all(len(m.content) > 4000 for m in stored)
    seen = [m for _, r in backend.requests for m in r.messages if m.role == "tool"]
    assert seen and all("cut to fit the context" in m.content for m in seen)


async def test_a_childs_report_too_long_for_its_parent_is_shortened(agents):
    long_report = "finding: " + "detail " * 2000

    def script(req: TurnRequest) -> Reply:
        kind = kind_of(req)
        if kind != "turn":
            return answer(req)
        if any(m.content.startswith("find part") for m in req.messages if m.role == "user"):
            return Reply(long_report)
        if not results(req):
            return Reply(calls=(task("find part 1", call_id="t1"),))
        return Reply("parent: " + results(req)["t1"])

    build, store = agents
    backend, runtime = build(script)
    record = store.create_session("parent", agent_type="general", workspace=str(harness_ws(store)))
    session = AgentSession(runtime, record)
    result = await session.send("delegate it")
    assert result.status == "done", result.error
    assert result.text == "parent: short report: part found"
    assert [k for k, _ in backend.prompts].count("shorten") == 1


def harness_ws(store: Store):
    folder = store.path.parent / "ws"
    folder.mkdir(exist_ok=True)
    return folder


async def test_a_message_that_can_never_fit_is_refused_and_not_stored(harness):
    build, store = harness
    backend, runtime = build(answer)
    record = store.create_session("paste", temperature=0.0, max_tokens=16)
    session = AgentSession(runtime, record)
    paste = "\n".join(f"{i}: " + prose(random.Random(i), 12) for i in range(2000))
    result = await session.send(paste)
    assert result.status == "error"
    tokens = backend.count([paste])[0]
    assert f"the message is {tokens:,} tokens; the context holds 1,024" in result.error
    assert store.session(record.id).messages == [] and backend.requests == []
    # the session is not dead: the next message is answered
    assert (await session.send("a short question")).status == "done"


async def test_compact_by_hand_keeps_the_last_exchange(harness):
    build, store = harness
    backend, runtime = build(answer)
    record = store.create_session("by hand", temperature=0.0, max_tokens=16)
    session = AgentSession(runtime, record)
    for i in range(3):
        assert (await session.send(f"question {i}")).status == "done"
    result = await session.compact("the questions asked")
    assert result.status == "done" and result.text.startswith("notes")
    [summary_request] = [r for _, r in backend.requests if kind_of(r) == "summary"]
    assert "with attention to: the questions asked" in summary_request.messages[-1].content
    assert "question 0" in summary_request.messages[-1].content
    view = session.model_messages()
    assert [m.role for m in view] == ["system", "user", "assistant"]
    assert view[1].content == "question 2"
