"""One rule for how weights are held (catalog/held_formats.py): the fit before a model loads
and the loader as it loads ask the same function with the same inputs, the bytes the fit
counts are the bytes the loader holds, and a profile's GPU is judged by its own memory on a
machine without it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucedesk import profile
from lucedesk.catalog import held_formats
from lucedesk.catalog.fit import estimate, expected_weights
from lucedesk.catalog.held_formats import BLOCK_TYPES, FORMATS, READ_TYPES, gpu_bytes_per_weight
from lucedesk.catalog.quants import LOADABLE, label_type
from lucedesk.catalog.summary import ModelSummary, summarize_path
from lucedesk.engine import held_weights
from lucedesk.engine.models.gguf_blocks import SUPPORTED_TYPES
from lucedesk.engine.models.loader import load_model
from lucedesk.kernels.blocks import planes_from_blocks
from tests.gguf_shapes import qwen3_30b_a3b_q4_k_m
from tests.gguf_writer import random_k_quant, write_gguf

GIB = 1 << 30
AVX2_FLAGS = "flags : fpu sse sse2 avx avx2 fma f16c bmi2"  # a Zen 3 desktop's kind
VNNI_FLAGS = AVX2_FLAGS + " avx512f avx512bw avx512_vnni avx512_bf16"

# Qwen2.5-7B-shaped, in Q4_K_M: the shape the issue's numbers were for.
SEVEN_B = ModelSummary(
    architecture="qwen2", params=7_615_616_512, quant="Q4_K_M", size_bytes=4_683_073_184,
    context=32768, num_layers=28, num_kv_heads=4, head_dim=128, vocab_size=152064,
    hidden_size=3584, tied_embeddings=False, mlp_type="Q4_K",
    matmul_numel={"Q4_K": 5_800_000_000, "Q6_K": 1_270_000_000}, embedding_type="Q4_K",
)  # fmt: skip


def test_an_avx2_cpu_is_told_what_the_loader_builds(monkeypatch):
    """A CPU without the VNNI kernels holds a bf16 model's weights in bf16: the fit says the
    same (it said 4-bit blocks, 4.2 GB, where the loader built 14 GB)."""
    _, config, _ = profile.resolve("cpu", ["dtype=bfloat16"])
    monkeypatch.setattr("lucedesk.catalog.fit.cpu_flags", lambda: AVX2_FLAGS)
    need = estimate(SEVEN_B, config, "cpu", "bfloat16")
    assert need.weight_format == "dtype" and need.weights == SEVEN_B.params * 2
    monkeypatch.setattr("lucedesk.catalog.fit.cpu_flags", lambda: VNNI_FLAGS)
    need = estimate(SEVEN_B, config, "cpu", "bfloat16")
    assert need.weight_format == "q4" and need.weights < SEVEN_B.params * 0.75


@pytest.mark.parametrize("paths", [(), ("vnni",), ("amx",), ("vnni", "amx")])
@pytest.mark.parametrize("wanted", ["auto", "dtype"])
def test_the_fit_and_the_loader_take_one_rule(tmp_path, monkeypatch, paths, wanted):
    """For a 4-bit file and an 8-bit one, on CPUs with each set of the C++ kernels' fast
    paths: the form the fit expects is the form the loader gives."""
    from lucedesk.config import EngineConfig

    monkeypatch.setattr(held_weights, "cpu_paths", lambda: frozenset(paths))
    config = EngineConfig(weights=wanted, kernels="cpu")
    for types in ({"attn_q": Q.Q4_K, "ffn_gate": Q.Q4_K}, {"attn_q": Q.Q8_0, "ffn_gate": Q.Q8_0}):
        path = write_gguf(tmp_path / f"{next(iter(types.values())).name}.gguf", types)
        held = expected_weights(summarize_path(path), config, "cpu", "bfloat16", frozenset(paths))
        expected = held.name if held is not None else "dtype"
        model = load_model(path, torch.bfloat16).model
        assert held_weights.apply_weight_format(model, wanted, "cpu") == expected


def test_gguf_types_have_one_home():
    """The types the loader reads are the registry's, every loadable quant label names one
    of them, and the registry's block sizes are gguf's."""
    assert SUPPORTED_TYPES == READ_TYPES
    assert {label_type(label) for label in LOADABLE} <= set(READ_TYPES)
    assert held_formats.block_shape("Q4_K") == (256, 144)
    assert held_formats.block_shape("IQ4_XS") == (256, 136)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_the_gpu_bytes_the_fit_counts_are_the_bytes_held(kind):
    n, k = 32, 512
    raw = random_blocks(kind, n, k)
    planes = planes_from_blocks(raw, kind, n, k)
    assert planes.nbytes == n * k * gpu_bytes_per_weight(kind)
    assert FORMATS["q4", "triton"].bytes_for(kind, n * k) == planes.nbytes


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of any held type with random contents."""
    from gguf import quants

    rng = np.random.default_rng(seed)
    if kind in ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
        return random_k_quant(n, k, Q[kind], rng).reshape(-1)
    values = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    return quants.quantize(values, Q[kind]).reshape(-1)


def test_a_30b_moe_in_q4_k_m_fits_an_r9700(tmp_path, monkeypatch):
    """A Qwen3-30B-A3B-shaped Q4_K_M file (18.6 GB) on the R9700 profile, judged on a
    machine without that GPU by the card's own memory: its weights held as blocks in
    under 19 GiB, with the profile's 98,304-token KV pool, fit."""
    from lucedesk.engine import fit_now

    path = qwen3_30b_a3b_q4_k_m(tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf")
    summary = summarize_path(path)
    assert 18.4e9 < summary.size_bytes < 18.7e9 and 30.4e9 < summary.params < 30.7e9
    _, r9700, _ = profile.resolve("r9700")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without it
    fit = fit_now(r9700)
    assert fit.where.startswith("31 GiB, the profile's device's")
    need = fit.need(summary)
    assert need.weight_format == "q4" and need.weights <= 19 * GIB
    assert need.kv_tokens == 98304 and need.total <= 31 * GIB
    assert fit.why_not(summary) is None


def test_lucedesk_models_judges_a_profiles_gpu_by_its_own_memory(tmp_path):
    """`lucedesk models --profile r9700` on a machine without that GPU lists what would
    fit the card (it stopped at "this machine's torch sees no GPU")."""
    folder = tmp_path / "home" / ".lmstudio" / "models" / "Qwen" / "Qwen3-30B-A3B-GGUF"
    folder.mkdir(parents=True)
    qwen3_30b_a3b_q4_k_m(folder / "Qwen3-30B-A3B-Q4_K_M.gguf")
    # CUDA_VISIBLE_DEVICES empty: no GPU, whatever this machine has.
    env = {"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "lucedesk", "models", "--profile", "r9700"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "Qwen3-30B-A3B" in line)
    assert "qwen3moe" in row and row.rstrip().endswith("yes")
    assert "fits judged by 31 GiB, the profile's device's" in result.stderr


def test_a_unified_apu_counts_the_smaller_of_its_driver_and_the_system(monkeypatch):
    """On a Strix Halo the driver's free count includes GTT beyond the carve-out (more than
    the total it reports); the system's available memory bounds it, and which number was
    used is said."""
    from lucedesk.engine import memory

    gib = GIB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * gib, 64 * gib))
    monkeypatch.setattr(memory, "_system_available", lambda: 90 * gib)
    free, said = memory.memory_basis(torch.device("cuda"), unified=True)
    assert free == 90 * gib
    assert "100.0 GiB free by the GPU's driver (of 64.0 GiB it reports: GTT beyond" in said
    assert said.endswith("90.0 GiB of system memory available: the system's")
    free, said = memory.memory_basis(torch.device("cuda"), unified=False)
    assert free == 100 * gib and "system" not in said


def test_a_mixtures_fused_gate_up_experts_are_read_alike(tmp_path):
    """Experts whose gate and up are one tensor (`ffn_gate_up_exps`): the fit reads their
    type (it read none, and priced the weights in bf16) as the loader does."""
    import gguf

    path = tmp_path / "fused.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    hidden, inter, experts, vocab = 256, 256, 4, 512
    for key, value in (("embedding_length", hidden), ("attention.head_count", 4),
                       ("attention.head_count_kv", 2), ("block_count", 1),
                       ("context_length", 4096), ("vocab_size", vocab),
                       ("expert_count", experts), ("expert_used_count", 2)):  # fmt: skip
        w.add_uint32(f"qwen3moe.{key}", value)
    rng = np.random.default_rng(0)

    def blocks(rows: int, cols: int) -> np.ndarray:
        return random_k_quant(rows, cols, Q.Q4_K, rng).reshape(rows, -1)

    w.add_tensor("token_embd.weight", blocks(vocab, hidden), raw_dtype=Q.Q4_K)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((experts, hidden), np.float32))
    fused = blocks(experts * 2 * inter, hidden).reshape(experts, 2 * inter, -1)
    w.add_tensor("blk.0.ffn_gate_up_exps.weight", fused, raw_dtype=Q.Q4_K)
    down = blocks(experts * hidden, inter).reshape(experts, hidden, -1)
    w.add_tensor("blk.0.ffn_down_exps.weight", down, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    summary = summarize_path(path)
    _, r9700, _ = profile.resolve("r9700")
    assert summary.mlp_type == "Q4_K"
    assert expected_weights(summary, r9700, "cuda", "bfloat16") is FORMATS["q4", "triton"]


def test_a_file_whose_tensors_disagree_with_its_metadata_is_refused_as_it_loads(tmp_path):
    """Weights left in the file until their form is chosen are checked against the model's
    shapes from the file's tensor table: the error names the tensor, as a dense load's
    does (the lazy load took any shape, and met it later, or not at all)."""
    import gguf

    from lucedesk.config import EngineConfig
    from lucedesk.engine.build import build_engine
    from lucedesk.errors import ModelLoadError

    writer = gguf.GGUFWriter.add_feed_forward_length
    try:  # the metadata says 512; the tensors are 384 wide
        gguf.GGUFWriter.add_feed_forward_length = lambda self, n: writer(self, 512)
        path = write_gguf(tmp_path / "bad.gguf", {"ffn_gate": Q.Q8_0}, intermediate=384)
    finally:
        gguf.GGUFWriter.add_feed_forward_length = writer
    config = EngineConfig(device="cpu", kernels="torch", dtype="float32", kv_pool_tokens=256)
    expected = r"tensor 'model.layers.0.mlp.gate_up_proj.weight' has shape \(768, 256\), " + (
        r"expected \(1024, 256\)"
    )
    with pytest.raises(ModelLoadError, match=expected):
        build_engine(path, config, check_fit=False)
