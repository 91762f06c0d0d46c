"""Models already on disk, used where they lie: a fake Ollama store (manifests and blobs as
Ollama writes them), LM Studio's folders and the Hugging Face cache, listed by
`lucedesk models --json` and loaded by the names it lists; what fits and what does not;
a chat template given on the command line or per model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from lucedesk import profile
from lucedesk.catalog.fit import Fit
from lucedesk.catalog.fit import estimate as estimate_memory
from lucedesk.catalog.resolve import resolve
from lucedesk.catalog.settings import chat_template
from lucedesk.catalog.summary import ModelSummary, summarize_path
from lucedesk.chat import ChatEncoder, ChatMessage
from lucedesk.engine import launch_engine, unreadable
from lucedesk.errors import ConfigError
from tests.gguf_writer import write_gguf

COMMIT = "c" * 40


ROLES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output")


def tiny_gguf(path: Path, arch: str = "llama") -> Path:
    roles = (*ROLES, "ffn_gate", "ffn_up", "ffn_down")
    return write_gguf(path, {r: Q.Q8_0 for r in roles}, arch=arch, seed=2)


def ollama_blob(root: Path, source: Path) -> str:
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, root / "blobs" / f"sha256-{digest}")
    return f"sha256:{digest}"


def ollama_manifest(root: Path, host: str, namespace: str, model: str, tag: str, digest: str):
    template = ollama_blob_text(root, "{{ .Prompt }}")
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": digest},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": 1},
            {"mediaType": "application/vnd.ollama.image.template", "digest": template, "size": 1},
        ],
    }
    path = root / "manifests" / host / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))


def ollama_blob_text(root: Path, text: str) -> str:
    digest = hashlib.sha256(text.encode()).hexdigest()
    (root / "blobs" / f"sha256-{digest}").write_text(text)
    return f"sha256:{digest}"


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """A home with an Ollama store, LM Studio's folder and the Hugging Face cache, each
    holding a tiny model; LM Studio also a model of an architecture lucedesk does not run."""
    home = tmp_path / "home"
    made = tmp_path / "made"
    model = tiny_gguf(made / "tiny-Q8_0.gguf")
    ollama = tmp_path / "ollama"
    digest = ollama_blob(ollama, model)
    ollama_manifest(ollama, "registry.ollama.ai", "library", "tiny", "latest", digest)
    ollama_manifest(ollama, "hf.co", "acme", "tiny-GGUF", "Q8_0", digest)
    ollama_manifest(ollama, "registry.ollama.ai", "someone", "tiny", "small", digest)
    studio = home / ".lmstudio" / "models" / "acme" / "tiny-GGUF"
    studio.mkdir(parents=True)
    shutil.copyfile(model, studio / "tiny-Q8_0.gguf")
    shutil.copyfile(model, studio / "mmproj-tiny-F16.gguf")  # a projector: not listed
    other = home / ".lmstudio" / "models" / "acme" / "odd-GGUF"
    other.mkdir(parents=True)
    tiny_gguf(other / "odd-Q8_0.gguf", arch="mamba")
    split = home / ".lmstudio" / "models" / "acme" / "split-GGUF" / "Q8_0"
    split.mkdir(parents=True)
    roles = (*ROLES, "ffn_gate", "ffn_up", "ffn_down")
    write_gguf(split / "split-Q8_0.gguf", {r: Q.Q8_0 for r in roles}, seed=2, split_max_tensors=8)
    snapshot = tmp_path / "hf" / "hub" / "models--acme--tiny-GGUF" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    shutil.copyfile(model, snapshot / "tiny-Q8_0.gguf")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(COMMIT)
    env = {"HOME": str(home), "OLLAMA_MODELS": str(ollama), "HF_HOME": str(tmp_path / "hf")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


NAMES = {
    "tiny:latest": "ollama",
    "someone/tiny:small": "ollama",
    "hf.co/acme/tiny-GGUF:Q8_0": "ollama",
    "acme/split-GGUF/Q8_0/split-Q8_0-00001-of-00003.gguf": "lmstudio",
    "acme/tiny-GGUF/tiny-Q8_0.gguf": "lmstudio",
    "acme/tiny-GGUF:Q8_0": "huggingface",
    "acme/odd-GGUF/odd-Q8_0.gguf": "lmstudio",
}


def test_models_json_lists_every_store_with_what_fits(stores):
    proc = subprocess.run(
        [sys.executable, "-m", "lucedesk", "models", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **stores},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    listed = {m["name"]: m for m in json.loads(proc.stdout)}
    assert {n: listed[n]["source"] for n in NAMES if n in listed} == NAMES
    assert not any("mmproj" in n for n in listed)
    tiny = listed["tiny:latest"]
    assert tiny["family"] == "llama" and tiny["quant"] == "Q8_0" and tiny["context"] == 1024
    assert tiny["size_bytes"] == Path(tiny["path"]).stat().st_size
    assert tiny["path"].endswith("blobs/sha256-" + Path(tiny["path"]).name[7:])
    assert tiny["fits"] is True
    assert listed["acme/odd-GGUF/odd-Q8_0.gguf"]["fits"] is False
    assert "architecture 'mamba'" in listed["acme/odd-GGUF/odd-Q8_0.gguf"]["problem"]
    split = listed["acme/split-GGUF/Q8_0/split-Q8_0-00001-of-00003.gguf"]
    assert split["fits"] is True and split["quant"] == "Q8_0"
    parts = Path(split["path"]).parent.glob("split-Q8_0-0000*-of-00003.gguf")
    assert split["size_bytes"] == sum(p.stat().st_size for p in parts)
    assert split["parameters"] == tiny["parameters"]  # every part's tensors counted


def test_every_listed_name_resolves_to_its_file(stores):
    from lucedesk.catalog.listing import list_models

    for model in list_models():
        assert resolve(model.name, print).path == model.path
    assert resolve("tiny", print).name == "tiny:latest"  # Ollama's tag implied, as Ollama does


def test_a_model_in_a_store_runs_under_its_name(stores):
    _, config, _ = profile.resolve("cpu", ["kv_pool_tokens=256", "max_slots=2"])
    found = resolve("tiny", print)
    built = launch_engine(found.path, config, name=found.name)
    try:
        assert built.loaded.name == "tiny:latest"
        assert built.engine.model_info.name == "tiny:latest"
    finally:
        built.engine.shutdown()


def test_lm_studios_downloads_folder_setting_is_read(stores, tmp_path):
    elsewhere = tmp_path / "big-disk" / "models"
    shutil.move(Path(stores["HOME"]) / ".lmstudio" / "models", elsewhere)
    settings = Path(stores["HOME"]) / ".lmstudio" / "settings.json"
    settings.write_text(json.dumps({"downloadsFolder": str(elsewhere)}))
    found = resolve("acme/tiny-GGUF/tiny-Q8_0.gguf", print)
    assert found.source == "lmstudio" and found.path.is_relative_to(elsewhere)


def test_a_model_that_cannot_fit_is_refused_with_both_numbers(stores, tmp_path):
    model = tiny_gguf(tmp_path / "x" / "m.gguf")
    proc = subprocess.run(
        [sys.executable, "-m", "lucedesk", "run", "--model", str(model), "-p", "hi"]
        + ["--set", "activation_reserve_mb=100000000"],
        capture_output=True,
        text=True,
        env={**os.environ, **stores},
        timeout=120,
    )
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("lucedesk: error: m.gguf needs ")
    assert "GiB of weights as " in error and "GiB of memory free: try a smaller quant" in error
    assert "Traceback" not in proc.stderr


def test_the_estimate_counts_weights_as_held_kv_and_the_reserve():
    """Weights as the held-format rule holds them (catalog/held_formats.py): on a CPU with
    the VNNI kernels a Q4_K_M file's blocks at their held sizes, the embedding in bf16 and
    a tied head from its blocks; on an R9700 (Triton) every matmul weight and the
    embedding as blocks, a tied head nothing more."""
    summary = ModelSummary(
        architecture="llama",
        params=1_000_000_000,
        quant="Q4_K_M",
        size_bytes=600_000_000,
        context=32768,
        num_layers=10,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=10_240,
        hidden_size=1024,
        tied_embeddings=True,
        mlp_type="Q4_K",
        matmul_numel={"Q4_K": 800_000_000, "Q6_K": 189_514_240},  # with the embedding: 1e9
        embedding_type="Q6_K",
    )
    _, cpu, _ = profile.resolve("cpu", ["max_model_len=4096", "weights=q4"])
    need = estimate_memory(summary, cpu, "cpu", "bfloat16")
    q4k, q6k = 0.59375, 0.828125  # the C++ kernels' Q4_K and Q6_K bytes a weight
    embedding = 10_240 * 1024
    head = int(embedding * q6k)  # the tied LM head, held from the embedding's blocks
    assert need.weight_format == "q4"
    assert need.weights == int(800e6 * q4k) + int(189_514_240 * q6k) + embedding * 2 + head
    assert need.kv_tokens == 4096 and need.kv == 4096 * 2 * 10 * 2 * 64 * 2
    assert need.reserve == cpu.activation_reserve_mb << 20
    _, gpu, _ = profile.resolve("r9700")
    held = estimate_memory(summary, gpu, "cuda", "bfloat16")
    gpu_q4k, gpu_q6k = 0.5 + 2 / 32 + 4 / 256, 0.75 + 1 / 16 + 2 / 256
    assert held.weight_format == "q4"
    gpu = int(800e6 * gpu_q4k) + int(189_514_240 * gpu_q6k) + int(embedding * gpu_q6k)
    assert held.weights == gpu
    assert held.kv_tokens == 98304  # the profile's fixed pool
    _, dense, _ = profile.resolve("r9700", ["weights=dtype"])
    assert estimate_memory(summary, dense, "cuda", "bfloat16").weights == 2_000_000_000
    fit = Fit(cpu, "cpu", "bfloat16", need.total, unreadable)
    assert fit(summary) and fit.why_not(summary) is None
    tight = Fit(cpu, "cpu", "bfloat16", need.total - 1, unreadable)
    assert not tight(summary) and tight.why_not(summary).startswith("needs ")


def test_a_chat_template_given_or_set_per_model_replaces_the_files(stores, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("MARK{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    settings = tmp_path / "models.toml"
    settings.write_text(f'["tiny:latest"]\nchat_template = "{template}"\n')
    assert chat_template("tiny:latest", None, settings) == template.read_text()
    assert chat_template("other", None, settings) is None
    assert chat_template("other", str(template), settings) == template.read_text()
    _, config, _ = profile.resolve("cpu", ["kv_pool_tokens=256", "max_slots=2"])
    found = resolve("tiny", print)
    built = launch_engine(found.path, config, name=found.name, chat_template=template.read_text())
    try:
        ids = ChatEncoder.of(built.engine).encode([ChatMessage("user", "hello")]).token_ids
        assert built.engine.tokenizer.decode(ids).startswith("MARK[hello]")
    finally:
        built.engine.shutdown()
    template.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ConfigError, match=r"t\.jinja: line 2: "):
        chat_template(None, str(template))
    settings.write_text('["tiny:latest"]\ntemplate = "x"\n')
    with pytest.raises(ConfigError, match="template: unknown"):
        chat_template("tiny:latest", None, settings)


def test_a_summary_reads_a_split_models_every_part(tmp_path):
    first = write_gguf(tmp_path / "m.gguf", {}, seed=3, split_max_tensors=8)
    whole = write_gguf(tmp_path / "w" / "m.gguf", {}, seed=3)
    split, single = summarize_path(first), summarize_path(whole)
    parts = sorted(tmp_path.glob("m-0000*-of-00003.gguf"))
    assert split.size_bytes == sum(p.stat().st_size for p in parts)
    assert abs(split.params - single.params) / single.params < 0.05
    assert split.num_layers == single.num_layers and split.context == single.context


def test_shutdown_waits_for_the_vocabulary_warm_up(stores, monkeypatch):
    """A process that exited while llguidance built its vocabulary on the warm-up thread
    could crash in native code (`lucedesk run` exited with SIGSEGV on short runs)."""
    import threading
    import time

    from lucedesk.engine.grammar import GrammarCompiler

    built_vocabulary = GrammarCompiler.ll_tokenizer.fget
    building = threading.Event()

    def slow(self):  # a large vocabulary's build, still under way at shutdown
        building.set()
        time.sleep(1.0)
        return built_vocabulary(self)

    monkeypatch.setattr(GrammarCompiler, "ll_tokenizer", property(slow))
    _, config, _ = profile.resolve("cpu", ["kv_pool_tokens=256", "max_slots=2"])
    found = resolve("tiny", print)
    built = launch_engine(found.path, config, name=found.name)
    assert building.wait(10)  # once the engine has been quiet a moment
    assert built.engine._warming.is_alive()
    built.engine.shutdown()
    assert not built.engine._warming.is_alive()


def test_an_f32_file_and_a_file_of_unread_types_are_judged_by_their_tensors(tmp_path):
    f32 = write_gguf(tmp_path / "f.gguf", {}, seed=4)
    summary = summarize_path(f32)
    summary.quant = "ALL_F32"  # as general.file_type 0 names it
    _, config, _ = profile.resolve("cpu")
    fit = Fit(config, "cpu", "bfloat16", 1 << 40, unreadable)
    assert summary.tensor_types == ("F32",) and fit.why_not(summary) is None
    summary.tensor_types = ("F32", "IQ4_XS")  # read since IQ4 blocks are held
    assert fit.why_not(summary) is None
    summary.tensor_types = ("F32", "IQ3_S")
    assert "IQ3_S are of a type lucedesk does not read" in fit.why_not(summary)
