"""The prefix cache on disk: segment files written and read back, what a broken or foreign
file gets, the size bound, and an engine restarted in a new process that reads a long
prompt's blocks back (proved by the blocks it counts and computes) with the same output."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lucedesk.engine.disk_cache import (
    MIN_BLOCKS,
    DiskPrefixCache,
    LoadedPrefix,
    block_digests,
    disk_cache_root,
)
from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import SamplingParams
from tests.engine_harness import make_engine

BS = 4
LAYOUT = [(torch.float32, (2, BS, 8)), (torch.float32, (2, BS, 8))]  # K and V of one layer


DISK = dict(max_slots=2, kv_pool_tokens=2048, disk_cache_gb=1, disk_cache_min_tokens=256)


def complete(engine, prompt: list[int], max_tokens: int):
    """Step an engine (no thread) until a greedy request for `prompt` ends; its handle."""
    handle = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    while not handle.finished:
        engine.step()
    return handle


def on_disk_read_slowly(loaded, config: dict, prompt: list[int], seconds: float, monkeypatch):
    """`prompt`'s blocks written to disk by an engine that computed it, and every later read
    of the disk's blocks made `seconds` slower."""
    engine = make_engine(loaded, **config)
    complete(engine, prompt, 2)
    engine.shutdown()
    real_read = DiskPrefixCache._read

    def slow_read(self, digests, start):
        time.sleep(seconds)
        return real_read(self, digests, start)

    monkeypatch.setattr(DiskPrefixCache, "_read", slow_read)


def open_cache(root: Path, key: str = "model-a", limit: int = 1 << 30) -> DiskPrefixCache:
    cache = DiskPrefixCache(root, key, LAYOUT, BS, limit, min_tokens=0)
    assert cache.flush(5)
    return cache


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, BS, 8, generator=g) for _ in LAYOUT]


def read(cache: DiskPrefixCache, digests, first: int = 0) -> LoadedPrefix | None:
    got = []
    cache.load(digests, first, got.append)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    return got[0]


def test_block_digests_chain_and_leave_the_last_token_out():
    tokens = list(range(100, 117))  # 17 tokens: four full blocks, the 4th not holding the last
    digests = block_digests(tokens, BS)
    assert len(digests) == 4
    assert block_digests(tokens[:13], BS) == digests[:3]  # a prefix's digests are a prefix
    other = block_digests([99, *tokens[1:]], BS)
    assert all(a != b for a, b in zip(digests, other))  # one token changes every later one
    # The same in another process (the pool's keys are Python hashes, which are not).
    code = (
        "from lucedesk.engine.disk_cache import block_digests; "
        f"print(block_digests({tokens}, {BS})[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digests[-1].hex()


def test_segments_are_written_and_read_back_across_a_restart(tmp_path):
    tokens = list(range(1, 42))  # 10 full blocks before the last token
    digests = block_digests(tokens, BS)
    first = blocks(6, 0)
    cache = open_cache(tmp_path)
    cache.save(digests[:6], 0, tokens[: 6 * BS], first)
    assert cache.flush(10)
    assert cache.known(digests) == 6
    # The session grows: only its new blocks are written, as a segment after the first.
    second = blocks(4, 1)
    cache.save(digests, 6, tokens[6 * BS : 10 * BS], second)
    assert cache.flush(10)
    cache.close()
    assert len(list(cache.folder.glob("*.kv"))) == 2

    again = open_cache(tmp_path)  # a new process reads the folder
    assert again.known(digests) == 10
    prefix = read(again, digests, first=2)
    assert prefix.first == 2 and prefix.end == 10
    whole = [torch.cat([a, b], dim=1)[:, 2:] for a, b in zip(first, second)]
    pieces = prefix.pieces(0, 8)
    assert [at for at, _ in pieces] == [0, 4]  # blocks 2-5 from one segment, 6-9 the other
    for k, want in enumerate(whole):
        assert torch.equal(torch.cat([t[k] for _, t in pieces], dim=1), want)
    (a, five), (b, six) = prefix.pieces(3, 2)  # blocks 5 and 6: one from each segment
    assert (a, b) == (0, 1)
    assert torch.equal(torch.cat([five[0], six[0]], dim=1), whole[0][:, 3:5])
    assert read(again, digests[:5], first=3) is None  # fewer than MIN_BLOCKS: not worth it
    assert MIN_BLOCKS == 4
    again.close()


def test_a_broken_or_foreign_file_is_ignored_with_a_log_line(tmp_path, caplog):
    tokens = list(range(1, 42))
    digests = block_digests(tokens, BS)
    cache = open_cache(tmp_path)
    cache.save(digests, 0, tokens[: 10 * BS], blocks(10, 0))
    assert cache.flush(10)
    cache.close()
    (path,) = cache.folder.glob("*.kv")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the blocks
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, "lucedesk.engine.disk_cache")
    again = open_cache(tmp_path)
    assert again.known(digests) == 10  # the header is fine...
    assert read(again, digests) is None  # ...the checksum is not: nothing is loaded
    assert "do not match their checksum" in caplog.text
    assert not path.exists() and again.known(digests) == 0
    again.close()

    # Cut short (a full disk) and written for another model or layout: ignored at start.
    # A header that lacks a field (same length, so only the field is wrong), too.
    cache = open_cache(tmp_path)
    cache.save(digests, 0, tokens[: 10 * BS], blocks(10, 0))
    other = [7 + t for t in tokens]
    cache.save(block_digests(other, BS), 0, other[: 10 * BS], blocks(10, 3))
    assert cache.flush(10)
    cache.close()
    path = cache.folder / f"{digests[-1].hex()}.kv"
    (damaged,) = [p for p in cache.folder.glob("*.kv") if p != path]
    path.write_bytes(path.read_bytes()[:-100])
    damaged.write_bytes(damaged.read_bytes().replace(b'"crc32"', b'"crc3x"', 1))
    foreign = cache.folder / "other.kv"
    foreign.write_bytes(b"not a cache file at all")
    caplog.clear()
    again = open_cache(tmp_path)
    assert again.known(digests) == 0
    assert "not what its header says" in caplog.text and "not a lucedesk KV file" in caplog.text
    assert "its header cannot be read ('crc32')" in caplog.text
    assert read(again, digests) is None  # the reading thread still answers
    again.close()
    other_layout = DiskPrefixCache(tmp_path, "model-a", LAYOUT[:1], BS, 1 << 30, 0)
    assert other_layout.flush(5) and other_layout.known(digests) == 0
    other_layout.close()


def test_the_least_recently_used_segments_go_first(tmp_path):
    each = 10 * BS * 4 + 2 * (2 * 10 * BS * 8 * 4)  # tokens + K + V of ten blocks
    cache = open_cache(tmp_path, limit=int(each * 2.5))
    prompts = [[s * 1000 + i for i in range(41)] for s in (1, 2, 3)]
    digests = [block_digests(p, BS) for p in prompts]
    for p, d in zip(prompts[:2], digests):
        cache.save(d, 0, p[: 10 * BS], blocks(10, 0))
        assert cache.flush(10)
        time.sleep(0.02)
    assert read(cache, digests[0]) is not None  # the first is used again: the second is older
    time.sleep(0.02)
    cache.save(digests[2], 0, prompts[2][: 10 * BS], blocks(10, 2))
    assert cache.flush(10)
    assert [cache.known(d) for d in digests] == [10, 0, 10]
    assert len(list(tmp_path.glob("*/*.kv"))) == 2
    cache.close()


RESTART = textwrap.dedent(
    """
    import json, sys, torch
    from lucedesk.engine.models.loader import load_model
    from lucedesk.engine.request import SamplingParams
    from tests.engine_harness import make_engine

    config = json.loads(sys.argv[2])
    engine = make_engine(load_model(sys.argv[1], torch.float32), **config)
    prompt = json.loads(sys.argv[3])
    handle = engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    while not handle.finished:
        engine.step()
    s = engine.scheduler
    print(json.dumps({
        "tokens": handle.result(timeout=0).token_ids,
        "disk_hit_tokens": s.num_disk_hit_tokens,
        "computed_prompt_tokens": s.num_computed_prompt_tokens,
    }))
    engine.shutdown()
    """
)


@pytest.mark.parametrize("kv_dtype", ["dtype", "int8"])
def test_an_engine_restarted_reads_a_long_prompt_back_from_disk(tiny_models, kv_dtype):
    """A 600-token prompt computed, the engine shut down; a new process with the same model
    reads its 37 full blocks (592 tokens) back from disk, computes only the last 8 tokens,
    and answers the same tokens (fp32, greedy)."""
    config = dict(
        max_slots=2,
        kv_pool_tokens=2048,
        disk_cache_gb=1,
        disk_cache_min_tokens=256,
        kv_dtype=kv_dtype,
    )
    loaded = load_model(tiny_models["llama"], torch.float32)
    prompt = [10 + (i * 7) % 300 for i in range(600)]
    engine = make_engine(loaded, **config)
    before = set(engine.disk.folder.glob("*.kv"))
    cold = complete(engine, prompt, 12).result(timeout=0).token_ids
    assert engine.scheduler.num_disk_hit_tokens == 0
    engine.shutdown()  # the write finishes first
    assert len(set(engine.disk.folder.glob("*.kv")) - before) == 1

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo))
    args = [str(tiny_models["llama"]), json.dumps(config), json.dumps(prompt)]
    out = subprocess.run(
        [sys.executable, "-c", RESTART, *args],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=repo,
    )
    warm = json.loads(out.stdout.strip().splitlines()[-1])
    assert warm["disk_hit_tokens"] == 592  # 37 blocks of 16, all but the last token's block
    assert warm["computed_prompt_tokens"] == 600 - 592
    assert warm["tokens"] == cold


def test_no_disk_cache_and_short_prompts_write_nothing(tiny_models):
    loaded = load_model(tiny_models["llama"], torch.float32)
    prompt = [10 + (i * 11) % 300 for i in range(300)]
    engine = make_engine(loaded, max_slots=2, kv_pool_tokens=2048, disk_cache_gb=0)
    assert engine.disk is None
    engine.shutdown()
    before = set(disk_cache_root().glob("*/*.kv"))
    engine = make_engine(
        loaded, max_slots=2, kv_pool_tokens=2048, disk_cache_gb=1, disk_cache_min_tokens=1024
    )
    complete(engine, prompt, 2)
    engine.shutdown()
    assert set(disk_cache_root().glob("*/*.kv")) == before


def test_a_request_waiting_for_the_disk_can_be_cancelled_and_shut_down(tiny_models, monkeypatch):
    """While its blocks are read (made slow here), a request can be cancelled, and an
    engine shutting down ends it: no handle is left open and no slot is held."""
    loaded = load_model(tiny_models["llama"], torch.float32)
    config = DISK
    prompt = [20 + (i * 13) % 300 for i in range(400)]
    on_disk_read_slowly(loaded, config, prompt, 0.5, monkeypatch)
    engine = make_engine(loaded, **config).start()
    cancelled = engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    time.sleep(0.1)
    assert engine.stats().num_waiting == 1  # it waits for the disk, counted as queued
    steps = engine.scheduler.step
    time.sleep(0.2)
    assert engine.scheduler.step - steps <= 2  # the engine thread waits, it does not spin
    cancelled.cancel()
    assert cancelled.result(timeout=10).finish_reason == "cancelled"
    left = engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    time.sleep(0.1)
    engine.shutdown()
    assert left.result(timeout=10).finish_reason == "cancelled"
    assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks


def test_a_prompt_read_from_disk_came_when_it_was_submitted(tiny_models, monkeypatch):
    """A prompt whose first blocks are read from disk (made slow here) came when it was
    submitted, not when the read ended: beside a stream submitted with it, the rest of it
    runs the fixed chunk, not chunks paced for that stream."""
    loaded = load_model(tiny_models["llama"], torch.float32)
    config = dict(DISK, kv_pool_tokens=4096, decode_slowdown=2.0, prefill_chunk_decoding=128)
    prompt = [20 + (i * 13) % 300 for i in range(400)]
    on_disk_read_slowly(loaded, config, prompt, 0.3, monkeypatch)
    engine = make_engine(loaded, **config)
    plans = []
    plan = engine.scheduler.plan
    monkeypatch.setattr(engine.scheduler, "plan", lambda: plans.append(plan()) or plans[-1])
    stream = engine.submit([5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True))
    longer = engine.submit(prompt + [30 + i % 200 for i in range(300)], SamplingParams(4))
    while not longer.take_ready():
        engine.step()
        time.sleep(0.001)
    assert engine.scheduler.num_disk_hit_tokens >= 384  # the read took place
    rows = [r for p in plans for r in p.prefills if r.request.request_id == longer.request_id]
    assert rows[0].num_tokens == 128 and len(rows) <= 3  # not paced for the stream
    stream.cancel()
    engine.shutdown()


def test_a_full_disk_leaves_no_partial_file_and_a_log_line(tmp_path, monkeypatch, caplog):
    import errno

    real_open = Path.open

    def full_disk_open(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        if "w" not in mode:
            return f
        written = []

        def write(data):
            if written:
                raise OSError(errno.ENOSPC, "No space left on device")
            written.append(len(data))
            return f.raw.write(data)

        f.write = write
        return f

    tokens = list(range(1, 42))
    digests = block_digests(tokens, BS)
    cache = open_cache(tmp_path)
    caplog.set_level(logging.WARNING, "lucedesk.engine.disk_cache")
    monkeypatch.setattr(Path, "open", full_disk_open)
    cache.save(digests, 0, tokens[: 10 * BS], blocks(10, 0))
    assert cache.flush(10)
    monkeypatch.undo()
    assert "10 blocks not written" in caplog.text and "No space left" in caplog.text
    assert not list(cache.folder.iterdir()) and cache.known(digests) == 0  # no temp file
    assert cache.has_room(10)  # what waited is no longer counted
    cache.close()


def test_no_more_than_a_bounded_amount_of_copies_waits_for_the_disk(tmp_path, monkeypatch):
    import lucedesk.engine.disk_cache as disk_cache

    cache = open_cache(tmp_path)
    one_block = cache.format.payload_bytes(1)
    monkeypatch.setattr(disk_cache, "QUEUE_BYTES", 12 * one_block)
    assert cache.has_room(12) and not cache.has_room(13)
    cache.close()


def test_a_segment_rewritten_after_its_parent_went_replaces_the_old_one(tmp_path):
    """Parent evicted, the same prompt saved again from its first block: the new file has
    the old child's name; the index follows the new file, and the parent of a segment is
    refreshed whenever the segment is written or read."""
    tokens = list(range(1, 42))
    digests = block_digests(tokens, BS)
    cache = open_cache(tmp_path)
    cache.save(digests[:6], 0, tokens[: 6 * BS], blocks(6, 0))
    assert cache.flush(10)
    parent = next(cache.folder.glob("*.kv"))
    os.utime(parent, (1, 1))
    cache.save(digests, 6, tokens[6 * BS : 10 * BS], blocks(4, 1))
    assert cache.flush(10)
    assert parent.stat().st_mtime > 1  # written after its child: refreshed
    child = next(p for p in cache.folder.glob("*.kv") if p != parent)
    cache._forget_path(parent)
    parent.unlink()  # evicted (by another process, say)
    assert cache.known(digests) == 0
    whole = blocks(10, 2)
    cache.save(digests, 0, tokens[: 10 * BS], whole)
    assert cache.flush(10)
    assert list(cache.folder.glob("*.kv")) == [child]  # the same name, a new file
    prefix = read(cache, digests, first=1)
    assert prefix is not None and prefix.end == 10
    for got, want in zip(prefix.pieces(0, 9)[0][1], whole):
        assert torch.equal(got, want[:, 1:])
    cache.close()


def test_a_load_that_fails_ends_its_request_and_leaves_no_false_cache(tiny_models, monkeypatch):
    """Copying blocks read from disk into the pool fails: the request ends with an error
    that says so, the blocks' keys are forgotten, and the same prompt then computes the
    same tokens as a cold run."""
    from lucedesk.engine.runner import TorchSeqEngine

    loaded = load_model(tiny_models["llama"], torch.float32)
    config = DISK
    prompt = [30 + (i * 17) % 300 for i in range(400)]
    engine = make_engine(loaded, **config)
    cold = complete(engine, prompt, 6)
    engine.shutdown()

    def broken(self, block_ids, tensors):
        raise RuntimeError("out of memory")

    engine = make_engine(loaded, **config)
    with monkeypatch.context() as m:
        m.setattr(TorchSeqEngine, "write_blocks", broken)
        failed = complete(engine, prompt, 6)
    result = failed.result(timeout=0)
    assert result.finish_reason == "error" and "loading cached blocks failed" in result.error
    pool = engine.scheduler.pool
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == pool.num_blocks
    again = complete(engine, prompt, 6)
    assert again.result(timeout=0).token_ids == cold.result(timeout=0).token_ids
    engine.shutdown()
