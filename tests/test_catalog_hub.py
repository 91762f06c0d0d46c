"""Models by Hugging Face name, against a fake hub on a local socket (HF_ENDPOINT): each
name syntax, the quant chosen to fit, a missing quant, gated repositories, a download cut
and resumed, a file whose sha256 differs, a safetensors repository, offline use, and a
split GGUF loading as the same model unsplit."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucedesk.catalog import download, hub
from lucedesk.catalog.resolve import HubName, hub_name, pull_hub, resolve
from lucedesk.engine.models.loader import load_model
from lucedesk.errors import PullError
from tests.conftest import write_tiny_model
from tests.fake_hub import GOOD_TOKEN, FakeHub, FakeRepo
from tests.gguf_writer import write_gguf
from tests.test_model_parity import our_logits

ROLES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output")
MLP = ("ffn_gate", "ffn_up", "ffn_down")
REPO = "acme/tiny-GGUF"


def tiny(path: Path, kind: Q, mlp: Q | None = None, split: int = 0) -> Path:
    types = {r: kind for r in ROLES} | {r: mlp or kind for r in MLP}
    return write_gguf(path, types, seed=1, split_max_tensors=split)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, bytes]:
    """A repository as llama.cpp quants are published: single files by quant, a split one
    in a folder, a projector and a README that are not models."""
    folder = tmp_path_factory.mktemp("quants")
    files = {
        "tiny-Q4_K_M.gguf": tiny(folder / "tiny-Q4_K_M.gguf", Q.Q4_K, Q.Q6_K),
        "tiny-Q8_0.gguf": tiny(folder / "tiny-Q8_0.gguf", Q.Q8_0),
        "tiny-F16.gguf": tiny(folder / "tiny-F16.gguf", Q.F16),
    }
    out = {name: path.read_bytes() for name, path in files.items()}
    first = tiny(folder / "tiny-Q6_K.gguf", Q.Q6_K, split=8)
    for i in range(1, 4):
        part = first.with_name(f"tiny-Q6_K-{i:05d}-of-00003.gguf")
        out[f"Q6_K/{part.name}"] = part.read_bytes()
    out["mmproj-tiny-F16.gguf"] = out["tiny-F16.gguf"]
    out["README.md"] = b"# tiny\n"
    return out


@pytest.fixture
def fake_hub(gguf_files, tmp_path, monkeypatch):
    with FakeHub() as server:
        server.add(FakeRepo(REPO, dict(gguf_files)))
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield server


def cached(repo: str = REPO) -> Path:
    return download.repo_folder(hub.cache_dir(), repo)


def say(_: str) -> None:
    pass


def test_names_of_every_syntax_are_read():
    assert hub_name("acme/tiny-GGUF") == HubName(REPO)
    assert hub_name("acme/tiny-GGUF:Q4_K_M") == HubName(REPO, "Q4_K_M")
    assert hub_name("hf.co/acme/tiny-GGUF:q8_0") == HubName(REPO, "q8_0")
    assert hub_name("https://huggingface.co/acme/tiny-GGUF") == HubName(REPO)
    assert hub_name("acme/tiny-GGUF/Q6_K/x-00001-of-00003.gguf") == HubName(
        REPO, file="Q6_K/x-00001-of-00003.gguf"
    )
    assert hub_name("https://huggingface.co/acme/tiny-GGUF/blob/main/tiny-Q8_0.gguf") == HubName(
        REPO, file="tiny-Q8_0.gguf"
    )
    assert hub_name("hf.co/acme/tiny-GGUF/resolve/main/Q6_K/x.gguf") == HubName(
        REPO, file="Q6_K/x.gguf"
    )
    assert hub_name("qwen3:30b") is None  # Ollama's, not a repository
    assert hub_name("models/local.gguf") is None  # a path
    assert hub_name("/abs/path") is None


def test_a_missing_file_in_a_folder_here_is_a_path_not_a_repository(tmp_path, monkeypatch):
    from lucedesk.errors import ModelLoadError

    (tmp_path / "models" / "qwen").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_name("models/qwen/x.gguf") is None
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        resolve("models/qwen/x.gguf", say)


def test_pull_by_each_syntax_into_the_hubs_cache(fake_hub, gguf_files):
    by_quant = pull_hub(hub_name("acme/tiny-GGUF:Q8_0"), say)
    by_ollama_name = pull_hub(hub_name("hf.co/acme/tiny-GGUF:q4_k_m"), say)
    by_file = pull_hub(hub_name("acme/tiny-GGUF/tiny-F16.gguf"), say)
    assert by_quant.name == "acme/tiny-GGUF:Q8_0"
    assert by_ollama_name.name == "acme/tiny-GGUF:Q4_K_M"
    assert by_file.name == "acme/tiny-GGUF/tiny-F16.gguf"
    commit = fake_hub.repos[REPO].commit
    for resolved, name in ((by_quant, "tiny-Q8_0.gguf"), (by_file, "tiny-F16.gguf")):
        # the layout huggingface_hub reads: a snapshot link to a blob named by its sha256
        assert resolved.path == cached() / "snapshots" / commit / name
        assert resolved.path.is_symlink()
        sha = hashlib.sha256(gguf_files[name]).hexdigest()
        assert resolved.path.resolve() == cached() / "blobs" / sha
        assert resolved.path.read_bytes() == gguf_files[name]
    assert (cached() / "refs" / "main").read_text() == commit
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(REPO, "tiny-Q8_0.gguf", cache_dir=hub.cache_dir())
    assert Path(found) == by_quant.path  # the library finds what lucedesk put there
    assert load_model(by_quant.path).name == "tiny-Q8_0"


def test_no_quant_named_takes_the_largest_that_fits_else_q4_k_m(fake_hub):
    largest = pull_hub(HubName(REPO), say, fits=lambda summary: True)
    assert largest.name == "acme/tiny-GGUF:Q8_0"  # F16 only where nothing is quantized
    small = pull_hub(HubName(REPO), say, fits=lambda s: s.size_bytes < 1_300_000, refresh=True)
    assert small.name == "acme/tiny-GGUF:Q6_K"
    none = pull_hub(HubName(REPO), say, fits=lambda summary: False, refresh=True)
    assert none.name == "acme/tiny-GGUF:Q4_K_M"


def test_a_missing_quant_lists_the_repositorys_quants(fake_hub):
    with pytest.raises(PullError) as refused:
        pull_hub(hub_name("acme/tiny-GGUF:Q3_K_M"), say)
    text = str(refused.value)
    assert "no quant Q3_K_M" in text
    for label in ("Q4_K_M (", "Q6_K (", "Q8_0 (", "F16 ("):
        assert label in text
    assert "mmproj" not in text and "README" not in text
    with pytest.raises(PullError, match="no such repository"):
        pull_hub(hub_name("acme/missing:Q8_0"), say)


def test_a_gated_repository_is_refused_without_a_token_and_served_with_one(
    fake_hub, gguf_files, monkeypatch
):
    fake_hub.add(FakeRepo("acme/gated", {"tiny-Q8_0.gguf": gguf_files["tiny-Q8_0.gguf"]}, True))
    with pytest.raises(PullError, match="gated.*HF_TOKEN"):
        pull_hub(hub_name("acme/gated:Q8_0"), say)
    assert not list((cached("acme/gated") / "blobs").glob("*"))
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    model = pull_hub(hub_name("acme/gated:Q8_0"), say)
    assert model.path.read_bytes() == gguf_files["tiny-Q8_0.gguf"]
    assert f"Bearer {GOOD_TOKEN}" in {s.authorization for s in fake_hub.gets("/resolve/")}


def test_a_cut_download_resumes_where_it_stopped(fake_hub, gguf_files, monkeypatch):
    data = gguf_files["tiny-Q8_0.gguf"]
    cut = len(data) // 3
    fake_hub.cut_after("tiny-Q8_0.gguf", cut)  # once: the same pull asks for the rest
    monkeypatch.setattr(download.time, "sleep", lambda s: None)
    model = pull_hub(hub_name("acme/tiny-GGUF:Q8_0"), say)
    assert model.path.read_bytes() == data
    assert [s.range for s in fake_hub.gets("/cdn/")] == [None, f"bytes={cut}-"]

    # A pull that gives up (the connection cut each time) keeps what came; the next one
    # (a new process, say) asks only for the rest.
    part = "Q6_K/tiny-Q6_K-00002-of-00003.gguf"
    second = gguf_files[part]
    fake_hub.cut_after(part, len(second) // 2, always=True)
    monkeypatch.setattr(download, "RETRIES", 1)
    with pytest.raises(PullError, match="the next pull resumes there"):
        pull_hub(hub_name("acme/tiny-GGUF:Q6_K"), say)
    kept = list((cached() / "blobs").glob("*.incomplete"))
    assert [p.stat().st_size for p in kept] == [len(second) // 2]
    del fake_hub.cut[part]
    model = pull_hub(hub_name("acme/tiny-GGUF:Q6_K"), say)
    assert fake_hub.gets(f"/cdn/{REPO}/{part}")[-1].range == f"bytes={len(second) // 2}-"
    assert not list((cached() / "blobs").glob("*.incomplete"))
    assert model.path.with_name(Path(part).name).read_bytes() == second


def test_a_file_whose_sha256_differs_is_refused_and_deleted(fake_hub):
    repo = fake_hub.repos[REPO]
    repo.advertised["tiny-Q8_0.gguf"] = "0" * 64
    with pytest.raises(PullError, match="sha256 .* differs from the hub's"):
        pull_hub(hub_name("acme/tiny-GGUF:Q8_0"), say)
    assert not list((cached() / "blobs").glob("*"))  # neither the blob nor a partial
    assert not list((cached() / "snapshots").rglob("*.gguf"))


def test_a_safetensors_repository_downloads_its_folder(fake_hub, tmp_path):
    folder = write_tiny_model(tmp_path / "src", "llama")
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    files["README.md"] = b"# a model\n"
    files["original/consolidated.00.pth"] = b"not wanted"
    fake_hub.add(FakeRepo("acme/tiny-llama", files))
    model = pull_hub(hub_name("acme/tiny-llama"), say)
    assert model.path.is_dir() and model.name == "acme/tiny-llama"
    got = {p.name for p in model.path.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= got
    assert "README.md" not in got and "original" not in got
    assert load_model(model.path).config.architecture == "llama"


def test_offline_the_cache_serves_what_it_holds(fake_hub, monkeypatch):
    pulled = pull_hub(hub_name("acme/tiny-GGUF:Q8_0"), say)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(fake_hub.seen)
    assert resolve("acme/tiny-GGUF:Q8_0", say).path == pulled.path
    assert resolve("acme/tiny-GGUF", say).path == pulled.path  # the one quant it holds
    with pytest.raises(PullError, match="HF_HUB_OFFLINE"):
        resolve("acme/tiny-GGUF:F16", say)
    assert len(fake_hub.seen) == before  # nothing asked of the network


def test_a_split_gguf_loads_as_the_same_model_unsplit(tmp_path):
    whole = tiny(tmp_path / "whole" / "m.gguf", Q.Q8_0, Q.Q4_K)
    first = tiny(tmp_path / "split" / "m.gguf", Q.Q8_0, Q.Q4_K, split=8)
    assert first.name == "m-00001-of-00003.gguf"
    a, b = load_model(whole), load_model(first)
    assert b.name == "m"  # not its first part's name
    ids = torch.randint(0, a.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(our_logits(a, ids.tolist()), our_logits(b, ids.tolist()))


def test_a_split_gguf_missing_a_part_names_it(tmp_path):
    from lucedesk.errors import ModelLoadError

    first = tiny(tmp_path / "m.gguf", Q.Q8_0, split=8)
    first.with_name("m-00002-of-00003.gguf").unlink()
    with pytest.raises(ModelLoadError, match="m-00002-of-00003.gguf: part 2 of 3 .* is missing"):
        load_model(first)
    with pytest.raises(ModelLoadError, match="is part 3 of 3 of a split model"):
        load_model(first.with_name("m-00003-of-00003.gguf"))


def test_the_command_line_pulls_runs_and_explains(fake_hub, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HOME": str(tmp_path / "hf")}

    def lucedesk(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "lucedesk", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    pulled = lucedesk("pull", "hf.co/acme/tiny-GGUF:Q6_K")
    assert pulled.returncode == 0, pulled.stderr
    assert "lucedesk --model acme/tiny-GGUF:Q6_K" in pulled.stderr
    ran = lucedesk(
        "run",
        "--model",
        "acme/tiny-GGUF:Q6_K",
        "-p",
        "hi",
        "--max-tokens",
        "3",
        "--set",
        "kv_pool_tokens=256",
    )
    assert ran.returncode == 0, ran.stderr
    missing = lucedesk("pull", "acme/tiny-GGUF:IQ2_XS")
    assert missing.returncode == 2
    assert "no quant IQ2_XS; it has Q4_K_M" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_busy_answers_are_asked_again_and_a_whole_answer_to_a_range_restarts(
    fake_hub, gguf_files, monkeypatch
):
    monkeypatch.setattr(download.time, "sleep", lambda s: None)
    fake_hub.fail["tiny-Q8_0.gguf"] = [503, 429]
    model = pull_hub(hub_name("acme/tiny-GGUF:Q8_0"), say)
    assert model.path.read_bytes() == gguf_files["tiny-Q8_0.gguf"]
    # A server that ignores Range answers the whole file: written from its start again.
    data = gguf_files["tiny-F16.gguf"]
    fake_hub.cut_after("tiny-F16.gguf", len(data) // 2)
    fake_hub.ignore_range.add("tiny-F16.gguf")
    model = pull_hub(hub_name("acme/tiny-GGUF:F16"), say)
    assert model.path.read_bytes() == data
    assert [s.range for s in fake_hub.gets("/cdn/acme/tiny-GGUF/tiny-F16")][-1] is not None


@pytest.mark.parametrize(
    "path, label",
    [
        ("Qwen3-30B-A3B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
        ("Qwen_Qwen3-30B-A3B-Q4_K_M.gguf", "Q4_K_M"),
        ("Qwen_Qwen3-30B-A3B-Q8_0/Qwen_Qwen3-30B-A3B-Q8_0-00001-of-00002.gguf", "Q8_0"),
        ("gpt-oss-20b-mxfp4.gguf", "MXFP4"),
        ("llama-2-7b.Q4_K_M.gguf", "Q4_K_M"),
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf", "BF16"),
        ("gemma-3-27b-it-IQ4_XS.gguf", "IQ4_XS"),
        ("Qwen2.5-7B-Instruct-q5_k_m.gguf", "Q5_K_M"),
        ("model.gguf", None),
    ],
)
def test_quant_labels_are_read_off_real_file_names(path, label):
    from lucedesk.catalog.quants import quant_label, quants_of

    assert quant_label(path) == label
    assert not quants_of([("mmproj-F16.gguf", 1), ("imatrix.gguf", 1), ("x.imatrix", 1)])
