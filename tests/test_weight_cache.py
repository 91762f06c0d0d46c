"""Held weights kept on disk (engine/weight_cache.py): the first start on a GGUF file packs
its weights and writes them; the next maps them without reading the file's tensors, and
gives the same greedy tokens (a dense 4-bit file, a mixture with 4-bit experts); a damaged
or foreign file is removed and the weights packed again; the folder stays under its bound,
least recently used out first."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucedesk.config import EngineConfig
from lucedesk.engine import weight_cache
from lucedesk.engine.build import build_engine
from lucedesk.engine.models import loader
from tests.engine_harness import random_jobs, run_jobs
from tests.gguf_writer import write_family_gguf, write_gguf
from tests.test_lowbit_weights import FOUR_BIT

CONFIG = dict(
    max_slots=4,
    kv_pool_tokens=2048,
    kernels="cpu",
    dtype="bfloat16",
    weights="auto",
    weight_cache_gb=1.0,
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "weights"
    monkeypatch.setenv("LUCEDESK_WEIGHT_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("weight-cache")
    return {
        "dense": write_gguf(root / "dense.gguf", FOUR_BIT),
        "moe": write_family_gguf(tiny_models["qwen3moe"], root / "moe.gguf", "qwen3moe", Q.Q4_0),
    }


def start(path, **config):
    """build_engine, then the end of the thread writing the weights."""
    built = build_engine(path, EngineConfig(**{**CONFIG, **config}))
    weight_cache.wait_for_writers()
    return built


def tokens_of(built) -> list[list[int]]:
    jobs = random_jobs(built.loaded, 4, 5, prompt_range=(1, 40), output_range=(4, 12))
    return run_jobs(built.engine, jobs)


def spy_reads(monkeypatch) -> list[bool]:
    reads: list[bool] = []
    real = loader.load_model

    def load(*args, read_weights=True, **kwargs):
        reads.append(read_weights)
        return real(*args, read_weights=read_weights, **kwargs)

    monkeypatch.setattr("lucedesk.engine.build.load_model", load)
    return reads


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_second_start_maps_what_the_first_packed(files, cache_dir, monkeypatch, kind):
    reads = spy_reads(monkeypatch)
    first = start(files[kind])
    assert first.weights == "q4"
    want = tokens_of(first)
    kept = list(cache_dir.glob("*.weights.pt"))
    assert len(kept) == 1 and reads == [True]
    second = start(files[kind])
    assert reads == [True, False], "the second start read no tensor of the file"
    assert second.weights == "q4"
    assert tokens_of(second) == want
    model = second.loaded.model
    if kind == "moe":
        assert model.stack is not None, "the mapped experts run in the layer stack"
        held = model.layers[0].moe.experts.quantized["gate_up"]
    else:
        held = model.layers[0].quantized["gate_up_proj"]
    assert not held.q.untyped_storage().resizable(), "a mapped file's storage, not a copy"
    assert len(list(cache_dir.glob("*.weights.pt"))) == 1


def test_other_settings_keep_files_of_their_own(files, cache_dir, caplog):
    start(files["dense"])
    start(files["dense"], weights="int8")
    assert len(list(cache_dir.glob("*.weights.pt"))) == 2
    start(files["dense"], weight_cache_gb=0)
    assert len(list(cache_dir.glob("*.weights.pt"))) == 2, "none written with the cache off"
    start(files["moe"], weight_cache_gb=1e-6)
    assert len(list(cache_dir.glob("*.weights.pt"))) == 2, "none larger than the bound"
    # A folder that cannot be written: a log line, the engine serves, nothing left behind.
    blocked = cache_dir.parent / "blocked"
    blocked.write_text("a file where the folder would be")
    with caplog.at_level(logging.WARNING, logger="lucedesk.engine.weight_cache"):
        built = build_engine(files["moe"], EngineConfig(**CONFIG))
        weight_cache.save_in_background(built.loaded.model, blocked / "m.weights.pt", 1.0)
        weight_cache.wait_for_writers()
    assert "not written" in caplog.text
    assert tokens_of(built)


@pytest.mark.parametrize("damage", ["cut", "foreign"])
def test_a_damaged_file_is_removed_and_packed_again(files, cache_dir, monkeypatch, caplog, damage):
    want = tokens_of(start(files["dense"]))
    (kept,) = cache_dir.glob("*.weights.pt")
    if damage == "cut":
        kept.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2])
    else:
        torch.save({"format": "q4", "params": {}, "held": {"lm_head": ({}, {})}}, kept)
    reads = spy_reads(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="lucedesk.engine.weight_cache"):
        again = start(files["dense"])
    assert "not used" in caplog.text and "removed" in caplog.text
    assert reads == [False, True], "tried the file, then read the model's own"
    assert tokens_of(again) == want
    assert len(list(cache_dir.glob("*.weights.pt"))) == 1, "written whole again"


def test_the_folder_keeps_under_its_bound(tmp_path):
    old = time.time() - 3600
    for i, size in enumerate([400, 300, 200]):
        path = tmp_path / f"m{i}{weight_cache.SUFFIX}"
        path.write_bytes(b"x" * size)
        os.utime(path, (old + i, old + i))  # m0 least recently used
    stale = tmp_path / f"m9{weight_cache.SUFFIX}.123.partial"
    stale.write_bytes(b"x")
    os.utime(stale, (old, old))
    weight_cache.evict(tmp_path, limit_gb=600e-9, keep=tmp_path / f"m0{weight_cache.SUFFIX}")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [f"m0{weight_cache.SUFFIX}", f"m2{weight_cache.SUFFIX}"]


def test_a_start_killed_while_writing_leaves_no_file_to_trust(files, cache_dir):
    """kill -9 while the held weights are written: what is left is a temporary file (swept
    later) or nothing, never a cut file under the final name; the next start packs again
    and serves the same tokens."""
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, signal
        from lucedesk.config import EngineConfig
        from lucedesk.engine.build import build_engine
        from lucedesk.engine import weight_cache
        real = weight_cache.torch.save
        def save(state, path):  # killed halfway through the write
            with open(path, "wb") as f:
                f.write(b"PK" + b"\\0" * 4096)
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        weight_cache.torch.save = save
        build_engine({str(files["dense"])!r}, EngineConfig(**{CONFIG!r}))
        weight_cache.wait_for_writers()
    """)
    env = {**os.environ, "LUCEDESK_WEIGHT_CACHE": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL
    assert not list(cache_dir.glob("*.weights.pt"))
    (partial,) = cache_dir.glob("*.weights.pt.*.partial")
    want = tokens_of(start(files["dense"]))
    assert len(list(cache_dir.glob("*.weights.pt"))) == 1
    old = time.time() - 3600
    os.utime(partial, (old, old))
    again = start(files["dense"])  # maps the file, sweeps the stale one
    assert tokens_of(again) == want and not partial.exists()
