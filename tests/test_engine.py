"""The engine thread: streaming, cancellation, stop conditions, faults, stats, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import FinishReason, SamplingParams
from lucedesk.errors import RequestError
from tests.conftest import wait_until
from tests.engine_harness import make_engine

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load_model(tiny_llama, torch.float32)


@pytest.fixture
def engine(loaded):
    engine = make_engine(loaded, max_slots=4, kv_pool_tokens=2048).start()
    yield engine
    engine.shutdown()


def prompt(loaded, n: int = 12) -> list[int]:
    return loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:n]


def test_stream_sync_and_result(engine, loaded):
    handle = engine.submit(prompt(loaded), GREEDY)
    outs = list(handle)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.token_ids) for o in outs) == 20
    done = handle.result(timeout=10)
    assert done.num_output_tokens == 20 and len(done.token_ids) == 20
    assert done.text == "".join(o.text for o in outs)
    assert done.text == loaded.tokenizer.decode(done.token_ids)


def test_stream_async(engine, loaded):
    async def main():
        handle = engine.submit(prompt(loaded), GREEDY)
        texts = [out.text async for out in handle]
        return texts, await handle.aresult()

    texts, done = asyncio.run(main())
    assert "".join(texts) == done.text and done.num_output_tokens == 20


def test_invalid_sampling_rejected(engine, loaded):
    for bad, field in [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-5), "top_k"),
        (SamplingParams(min_p=2.0), "min_p"),
        (SamplingParams(stop=("",)), "stop"),
    ]:
        with pytest.raises(RequestError) as err:
            engine.submit(prompt(loaded), bad)
        assert err.value.field == field and field in str(err.value)


def test_impossible_requests_rejected(engine, loaded):
    with pytest.raises(RequestError, match="context limit"):
        engine.submit(prompt(loaded), SamplingParams(max_tokens=5000))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.submit([1, 2, 10**6], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        engine.submit([], GREEDY)


def test_cancel_mid_decode_frees_slot_and_blocks(engine, loaded):
    handle = engine.submit(prompt(loaded), SamplingParams(max_tokens=900, ignore_eos=True))
    wait_until(lambda: engine.stats().num_running == 1 and engine.stats().blocks_used > 0)
    handle.cancel()
    done = handle.result(timeout=10)
    assert done.finish_reason is FinishReason.CANCELLED
    wait_until(lambda: engine.stats().blocks_used == 0 and engine.stats().num_running == 0)


def test_stop_string_is_not_sent(engine, loaded):
    free = engine.submit(prompt(loaded), GREEDY).result(timeout=10)
    assert len(free.text) > 6
    stop = free.text[3:6]
    done = engine.submit(
        prompt(loaded),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,)),
    ).result(timeout=10)
    assert done.finish_reason is FinishReason.STOP
    assert stop not in done.text and free.text.startswith(done.text)
    assert done.text == free.text[: free.text.index(stop)]


def test_stop_token_ids(engine, loaded):
    free = engine.submit(prompt(loaded), GREEDY).result(timeout=10)
    stop_id = free.token_ids[5]
    done = engine.submit(
        prompt(loaded),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,)),
    ).result(timeout=10)
    assert done.finish_reason is FinishReason.STOP
    assert done.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


def test_injected_fault_fails_one_request_and_engine_keeps_serving(engine, loaded):
    runner = engine.seq_engine
    real_execute = runner.execute

    def faulty(plan):
        if any(r.request.owner == "poison" for r in plan.rows):
            raise RuntimeError("injected fault")
        return real_execute(plan)

    runner.execute = faulty
    try:
        good = [engine.submit(prompt(loaded), GREEDY, owner=f"ok{i}") for i in range(2)]
        bad = engine.submit(prompt(loaded), GREEDY, owner="poison")
        done = bad.result(timeout=20)
        assert done.finish_reason is FinishReason.ERROR and "injected fault" in done.error
        for h in good:
            assert h.result(timeout=20).finish_reason is FinishReason.LENGTH
    finally:
        runner.execute = real_execute
    assert engine.running
    after = engine.submit(prompt(loaded), GREEDY).result(timeout=20)
    assert after.num_output_tokens == 20
    wait_until(lambda: engine.stats().blocks_used == 0)


def test_stats_snapshot_shows_slots(engine, loaded):
    handles = [
        engine.submit(
            prompt(loaded), SamplingParams(max_tokens=400, ignore_eos=True), owner=f"pane{i}"
        )
        for i in range(2)
    ]
    wait_until(lambda: sum(s.phase == "decode" for s in engine.stats().slots) == 2)
    stats = engine.stats()
    busy = [s for s in stats.slots if s.request_id]
    assert sorted(s.owner for s in busy) == ["pane0", "pane1"]
    assert all(s.blocks > 0 and s.context_tokens > 12 for s in busy)
    assert stats.blocks_used == sum(s.blocks for s in busy)
    assert len(stats.slots) == 4
    for h in handles:
        h.cancel()
    for h in handles:
        h.result(timeout=10)


def test_shutdown_finishes_every_open_request(loaded):
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=2048).start()
    handles = [
        engine.submit(prompt(loaded), SamplingParams(max_tokens=900, ignore_eos=True))
        for _ in range(4)
    ]
    engine.shutdown()
    for h in handles:
        assert h.result(timeout=5).finish_reason is FinishReason.CANCELLED
    assert not engine.running
    with pytest.raises(RequestError, match="shutting down"):
        engine.submit(prompt(loaded), GREEDY)


def test_the_vocabulary_warm_up_waits_until_the_engine_is_quiet(loaded):
    """llguidance's vocabulary build holds the interpreter lock throughout (~0.2 s for 49k
    tokens): begun at ready, it held up the first request as long. It begins once the
    engine has had no work for a while."""
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=2048).start()
    try:
        long = SamplingParams(max_tokens=1000, ignore_eos=True)
        handles = [engine.submit(prompt(loaded), long) for _ in range(4)]  # 2 at a time
        wait_until(lambda: engine.stats().num_running == 2)
        engine.warm_up(quiet=0.05)
        time.sleep(0.3)
        assert not handles[-1].finished and engine.quiet_for() == 0.0
        assert engine.grammars._ll_tokenizer is None  # not while requests run
        for handle in handles:
            handle.cancel()
            handle.result(timeout=10)
        wait_until(lambda: engine.grammars._ll_tokenizer is not None, timeout=10)
        assert engine.quiet_for() >= 0.05
    finally:
        engine.shutdown()


def test_drain_lets_running_requests_finish(loaded):
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=2048).start()
    handles = [engine.submit(prompt(loaded), GREEDY) for _ in range(3)]
    engine.shutdown(drain=True)
    assert all(h.result(timeout=5).finish_reason is FinishReason.LENGTH for h in handles)


def test_queue_limit(loaded):
    from lucedesk.engine.engine import QueueFullError

    engine = make_engine(loaded, max_slots=1, kv_pool_tokens=2048, max_waiting=2)
    # Not started: nothing leaves the queue.
    engine.submit(prompt(loaded), GREEDY)
    engine.submit(prompt(loaded), GREEDY)
    with pytest.raises(QueueFullError):
        engine.submit(prompt(loaded), GREEDY)
    engine.start()
    engine.shutdown()


def test_weight_formats_follow_the_model_and_kernels(tiny_llama):
    """`auto` takes int8 weights only where the C++ kernels run a bf16 model fast (AMX tiles
    or AVX512-VNNI), on the VNNI kernels wherever they run (AMX tiles widen every weight
    each call, which one decode row pays alone), named or not. Asking for int8 elsewhere,
    or for another format once quantized, is a clear configuration error."""
    from lucedesk.config import EngineConfig
    from lucedesk.engine.build import apply_weight_format
    from lucedesk.errors import ConfigError
    from lucedesk.kernels.quantized import (
        Int8Weight,
        LowBitWeight,
        int8_tiles_available,
        lowbit_vector_available,
    )

    with pytest.raises(ConfigError, match="weights must be one of auto, dtype, int8, q4"):
        EngineConfig(weights="int4").validate()
    fp32 = load_model(tiny_llama, torch.float32)
    assert apply_weight_format(fp32.model, "auto", "cpu") == "dtype"
    with pytest.raises(ConfigError, match="on the cpu kernels need a bfloat16 model"):
        apply_weight_format(fp32.model, "int8", "cpu")
    bf16 = load_model(tiny_llama, torch.bfloat16)
    with pytest.raises(ConfigError, match="not on the torch kernels"):
        apply_weight_format(bf16.model, "int8", "torch")
    other = load_model(tiny_llama, torch.bfloat16)
    assert apply_weight_format(other.model, "auto", "cpu") == (
        "int8" if int8_tiles_available() or lowbit_vector_available() else "dtype"
    )
    held = other.model.layers[0].quantized.get("qkv_proj")
    if lowbit_vector_available():
        assert isinstance(held, LowBitWeight) and held.bits == 8
    elif int8_tiles_available():
        assert isinstance(held, Int8Weight)
    engine = make_engine(bf16, weights="int8", max_slots=2, kv_pool_tokens=1024).start()
    try:
        assert bf16.model.weight_format == "int8"
        named = bf16.model.layers[0].quantized["qkv_proj"]
        assert isinstance(named, LowBitWeight if lowbit_vector_available() else Int8Weight)
        assert bf16.model.layers[0].qkv_proj.numel() == 0  # the bf16 copy is released
        out = engine.submit([5, 6, 7, 8], GREEDY).result(timeout=60)
        assert len(out.token_ids) == GREEDY.max_tokens
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError, match="load it again"):
        apply_weight_format(bf16.model, "dtype", "cpu")
    # Matmul inputs not in whole groups of 32: auto keeps bf16, int8 says why it cannot.
    from lucedesk.engine.models.config import ModelConfig
    from lucedesk.engine.models.decoder import DecoderModel

    odd = DecoderModel(ModelConfig("llama", 64, 48, 96, 1, 2, 1, 24), torch.bfloat16)
    assert apply_weight_format(odd, "auto", "cpu") == "dtype"
    with pytest.raises(ConfigError, match="multiples of 32"):
        apply_weight_format(odd, "int8", "cpu")


def test_no_sampler_state_outlives_its_request(loaded):
    """Sampling keeps a base seed per request; every one is dropped once its request is
    done, the last batch's included (no later request is needed to clear them)."""
    engine = make_engine(loaded, max_slots=4, kv_pool_tokens=4096).start()
    sampler = engine.seq_engine.sampler
    try:
        params = [SamplingParams(max_tokens=8, temperature=0.9, seed=i) for i in range(12)]
        handles = [engine.submit(prompt(loaded), p) for p in params]
        outs = [h.result(timeout=30).token_ids for h in handles]
        assert len({tuple(o) for o in outs}) > 1  # the seeds do differ
        wait_until(lambda: not sampler._bases, 5)
    finally:
        engine.shutdown()


def test_drain_that_times_out_cancels_the_rest(loaded):
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=4096).start()
    long = SamplingParams(max_tokens=1000, ignore_eos=True)
    handles = [engine.submit(prompt(loaded), long) for _ in range(3)]
    wait_until(lambda: engine.stats().num_running == 2)
    engine.shutdown(drain=True, timeout=0.3)
    results = [h.result(timeout=10) for h in handles]
    assert {r.finish_reason for r in results} == {FinishReason.CANCELLED}
    assert all(r.num_output_tokens < 1000 for r in results)
    assert not engine.running
    assert engine.scheduler.pool.num_used_blocks == 0
