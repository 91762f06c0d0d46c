"""Hardware profiles: detection, validation, overrides, KV pool sizing, switching."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from lucedesk import profile
from lucedesk.catalog.fit import derive_pool_tokens, kv_bytes_per_token, pool_basis
from lucedesk.config import EngineConfig
from lucedesk.engine.models.config import ModelConfig
from lucedesk.engine.models.loader import load_model
from lucedesk.engine.request import FinishReason, SamplingParams
from lucedesk.errors import ConfigError
from tests.engine_harness import make_engine


@pytest.fixture
def no_user_dir(tmp_path):
    return tmp_path / "none"


@pytest.mark.parametrize(
    "device,expected",
    [
        (profile.DeviceInfo("rocm", "AMD Radeon AI PRO R9700", "gfx1201:sramecc-:xnack-"), "r9700"),
        (profile.DeviceInfo("rocm", "AMD Radeon Graphics", "gfx1151"), "strix-halo"),
        (profile.DeviceInfo("rocm", "AMD Radeon RX 7900 XTX", "gfx1100"), "cuda"),
        (profile.DeviceInfo("cuda", "NVIDIA H200", ""), "cuda"),
        (profile.DeviceInfo("cpu"), "cpu"),
    ],
)
def test_detection(device, expected, no_user_dir):
    chosen, why = profile.detect(profile.all_profiles(no_user_dir), device)
    assert chosen.name == expected
    assert expected in why


def test_every_shipped_profile_validates(no_user_dir):
    profiles = profile.all_profiles(no_user_dir)
    assert set(profiles) == {"r9700", "strix-halo", "cpu", "cuda"}
    for p in profiles.values():
        assert p.builtin and p.description
        p.engine.validate()
    assert profiles["r9700"].engine.kv_pool_tokens == 98304
    assert profiles["strix-halo"].engine.unified_memory
    assert (
        profiles["strix-halo"].engine.prefill_chunk_decoding
        < profiles["strix-halo"].engine.prefill_chunk_idle
    )


BROKEN = [
    ("[engine]\nmax_slots = 0\n", "max_slots must be a positive integer"),
    ('[engine]\nmax_slots = "four"\n', "max_slots must be an integer"),
    ("[engine]\nslots = 4\n", "unknown setting 'slots'"),
    ("[engine]\nblock_size = 12\n", "block_size must be one of 8, 16, 32, 64, 128"),
    ('[engine]\ndtype = "float8"\n', "dtype must be one of auto, float32"),
    ('[engine]\nkernels = "flash"\n', "kernels must be one of auto, torch, cpu, triton"),
    ("[engine]\nkv_memory_fraction = 1.5\n", "kv_memory_fraction must be in (0, 0.95]"),
    ('[engine]\nprefix_cache = "yes"\n', "prefix_cache must be true or false"),
    (
        "[engine]\nmax_num_batched_tokens = 4\nmax_slots = 8\n",
        "max_num_batched_tokens must be at least max_slots (8)",
    ),
    ('[match]\nbackend = "tpu"\n', "backend must be one of cpu, cuda, rocm, gpu"),
    ('[match]\ngfx_arch = "gfx1201"\n', "gfx_arch must be a list of strings"),
    ('[match]\nvendor = "amd"\n', "unknown key 'vendor' in [match]"),
    ('colour = "blue"\n', "unknown key 'colour'"),
    ("[engine\nmax_slots = 2\n", "invalid TOML"),
]


@pytest.mark.parametrize("text,message", BROKEN)
def test_broken_profile_files_name_file_key_and_rule(tmp_path, text, message):
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        profile.load_profile(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_user_profile_overrides_builtin_and_resolves_by_path(tmp_path):
    (tmp_path / "cpu.toml").write_text('[match]\nbackend = "cpu"\n[engine]\nmax_slots = 3\n')
    chosen, config, _ = profile.resolve(None, [], profile.DeviceInfo("cpu"), tmp_path)
    assert chosen.name == "cpu" and not chosen.builtin and config.max_slots == 3
    chosen, config, why = profile.resolve(str(tmp_path / "cpu.toml"), ["max_slots=5"])
    assert config.max_slots == 5 and "profile file" in why


def test_command_line_overrides(no_user_dir):
    _, config, _ = profile.resolve(
        "cpu", ["max_slots=2", "dtype=float32", "prefix_cache=off"], user_dir=no_user_dir
    )
    assert (config.max_slots, config.dtype, config.prefix_cache) == (2, "float32", False)
    for bad, message in [
        ("max_slots", "expected KEY=VALUE"),
        ("nope=1", "unknown setting"),
        ("max_slots=x", "not a valid int"),
        ("prefix_cache=maybe", "not a valid bool"),
    ]:
        with pytest.raises(ConfigError, match=message):
            profile.resolve("cpu", [bad], user_dir=no_user_dir)
    with pytest.raises(ConfigError, match="unknown profile 'nope'"):
        profile.resolve("nope", [], user_dir=no_user_dir)


SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, max_position_embeddings=8192)
QWEN3_8B = ModelConfig(
    "qwen3", 151936, 4096, 12288, 36, 32, 8, 128, max_position_embeddings=40960, qk_norm=True
)


def test_kv_pool_derivation_by_hand():
    # SmolLM2-135M in bf16: 2 (K,V) * 30 layers * 3 KV heads * 64 dims * 2 bytes = 23,040 B.
    assert kv_bytes_per_token(SMOLLM2, "bfloat16") == 23_040
    # Qwen3-8B in bf16: 2 * 36 * 8 * 128 * 2 = 147,456 B (144 KiB) per token.
    assert kv_bytes_per_token(QWEN3_8B, "bfloat16") == 147_456
    gib = 1 << 30
    # 8 GiB free, half of it for KV: 4 GiB / 147,456 B = 29,127.1 -> 29,120 in blocks of 16.
    cfg = EngineConfig(max_slots=16, kv_memory_fraction=0.5)
    assert derive_pool_tokens(cfg, QWEN3_8B, "bfloat16", 8 * gib, 40960) == 29_120
    # The R9700 profile's fixed pool is taken as given: 98,304 tokens = 13.5 GiB for Qwen3-8B.
    r9700 = profile.all_profiles()["r9700"].engine
    assert derive_pool_tokens(r9700, QWEN3_8B, "bfloat16", 20 * gib, 16384) == 98_304
    assert 98_304 * 147_456 / gib == 13.5
    # Derived, but never more than every slot at full context: 16 * 8,192 for SmolLM2.
    assert derive_pool_tokens(cfg, SMOLLM2, "bfloat16", 100 * gib, 8192) == 131_072
    # 2 GiB free at a quarter: 512 MiB / 23,040 B = 23,301.7 -> 23,296.
    quarter = EngineConfig(kv_memory_fraction=0.25)
    assert derive_pool_tokens(quarter, SMOLLM2, "bfloat16", 2 * gib, 8192) == 23_296


QWEN3_30B_A3B = ModelConfig(
    "qwen3moe", 151936, 2048, 6144, 48, 32, 4, 128, max_position_embeddings=40960, qk_norm=True
)


def test_a_unified_memory_pool_is_what_the_slots_can_use():
    """Strix Halo's pool is its six slots at the context limit, whatever the free memory
    would allow, and says so; less only where its share of free memory is less."""
    gib = 1 << 30
    strix = profile.all_profiles()["strix-halo"].engine
    assert strix.unified_memory and not strix.kv_pool_tokens
    # Qwen3-30B-A3B: 2 * 48 * 4 * 128 * 2 = 98,304 B a token; 6 x 8,192 = 4.5 GiB of 96.
    tokens, why = pool_basis(strix, QWEN3_30B_A3B, "bfloat16", 96 * gib, 8192)
    assert (tokens, why) == (49_152, "6 slots x 8192 tokens")
    assert tokens * kv_bytes_per_token(QWEN3_30B_A3B, "bfloat16") / gib == 4.5
    # 4 GiB free: half of it, 2 GiB / 98,304 B = 21,845.3 -> 21,840 in blocks of 16.
    tokens, why = pool_basis(strix, QWEN3_30B_A3B, "bfloat16", 4 * gib, 8192)
    assert (tokens, why) == (21_840, "0.5 of 4.0 GiB free (unified)")
    r9700 = profile.all_profiles()["r9700"].engine
    pinned = pool_basis(r9700, QWEN3_8B, "bfloat16", 20 * gib, 16384)
    assert pinned == (98_304, "set by kv_pool_tokens")


def test_profiles_for_a_device_this_machine_lacks_are_shown_not_run(
    tiny_llama, capsys, monkeypatch
):
    """`lucedesk profiles --profile strix-halo` on a machine without its GPU shows what the
    pool would hold at most; `run` on it is a clear error, not a traceback. (torch is told
    it sees no GPU, so a machine that has one runs the same test.)"""
    from lucedesk.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["profiles", "--profile", "strix-halo", "--model", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    assert "tokens at most, the free memory measured on the device" in out
    assert main(["run", "--profile", "strix-halo", "--model", str(tiny_llama), "-p", "hi"]) != 0
    err = capsys.readouterr().err
    assert "sees no GPU" in err and "Traceback" not in err
    assert gc.isenabled() and gc.get_freeze_count() == 0  # a failed start leaves it so too


def test_a_command_leaves_the_collector_as_it_found_it(tiny_llama, capsys):
    """`run` starts with collection off and freezes what its start made (cli.main,
    commands.settle); once it returns, collection is on and nothing stays frozen, so a
    caller in the same process gets its collector back."""
    from lucedesk.cli import main

    assert gc.isenabled() and gc.get_freeze_count() == 0
    args = ["run", "--model", str(tiny_llama), "-p", "hi", "--max-tokens", "2", "--raw"]
    assert main(args) == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_switching_engines_with_requests_in_flight_loses_none(tiny_llama):
    loaded = load_model(tiny_llama, torch.float32)
    first = make_engine(loaded, max_slots=2, kv_pool_tokens=2048).start()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = loaded.tokenizer.encode("hello there")
    handles = [first.submit(prompt, params) for _ in range(5)]
    first.shutdown(drain=True)  # what a profile switch does before the rebuild
    done = [h.result(timeout=10) for h in handles]
    assert all(d.finish_reason is FinishReason.LENGTH and d.num_output_tokens == 40 for d in done)
    second = make_engine(loaded, max_slots=3, kv_pool_tokens=1024).start()
    again = second.submit(prompt, params).result(timeout=10)
    assert again.token_ids == done[0].token_ids
    # Without draining, every open request ends cancelled and says so.
    open_handles = [
        second.submit(prompt, SamplingParams(max_tokens=900, ignore_eos=True)) for _ in range(4)
    ]
    second.shutdown(drain=False)
    assert {h.result(timeout=10).finish_reason for h in open_handles} == {FinishReason.CANCELLED}


def test_int8_kv_holds_twice_the_tokens():
    """The pool derived from the same memory holds ~2x the tokens with 8-bit K/V (values plus
    a float32 scale per token and KV head)."""
    assert kv_bytes_per_token(SMOLLM2, "bfloat16", "int8") == 2 * 30 * 3 * (64 + 4)
    config = EngineConfig(kv_dtype="int8", kv_memory_fraction=0.5)
    plain = derive_pool_tokens(
        config.replace(kv_dtype="dtype"), SMOLLM2, "bfloat16", 1 << 30, 10**9
    )
    eight = derive_pool_tokens(config, SMOLLM2, "bfloat16", 1 << 30, 10**9)
    assert 1.85 < eight / plain < 1.9  # 128 / 68 bytes a row


def test_profiles_command_says_what_the_pool_and_the_disk_caches_hold(
    tiny_llama, capsys, tmp_path, monkeypatch
):
    from lucedesk.cli import main
    from lucedesk.engine.disk_cache import disk_cache_root

    monkeypatch.setenv("LUCEDESK_KV_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("LUCEDESK_WEIGHT_CACHE", str(tmp_path / "weights"))
    folder = disk_cache_root() / "some-model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.kv").write_bytes(b"\0" * 20_000_000)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "m.weights.pt").write_bytes(b"\0" * 30_000_000)
    try:
        assert main(["profiles", "--profile", "cpu", "--model", str(tiny_llama)]) == 0
        out = capsys.readouterr().out
        assert "reserved, not written" in out
        assert re.search(r"KV pool +\d+ tokens \(\d+ MiB\): 16 slots x \d+ tokens", out)
        assert f"prefix cache on disk     0.02 of 8 GB in {tmp_path / 'kv'} " in out
        assert f"held weights on disk     0.03 of 32 GB in {tmp_path / 'weights'}" in out
        assert "(prompts of 1024+ tokens)" in out
        assert (
            main(["profiles", "--profile", "cpu", "--model", str(tiny_llama), "--no-disk-cache"])
            == 0
        )
        assert "prefix cache on disk     off" in capsys.readouterr().out
    finally:
        (folder / "a.kv").unlink()
