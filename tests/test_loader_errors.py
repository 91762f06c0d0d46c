"""Bad model inputs: each a one-line error naming the file and the problem."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from lucedesk.engine.models.loader import load_model
from lucedesk.errors import ModelLoadError
from tests.gguf_writer import write_gguf

SMALL = dict(hidden=64, intermediate=128)


def test_truncated_gguf(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {}, **SMALL)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"m\.gguf: truncated: tensor '.*'"):
        load_model(path)


def test_truncated_header(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {}, **SMALL)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="truncated GGUF header"):
        load_model(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"hello world, not a model at all" * 4)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(path)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_model(tmp_path / "nope.gguf")


def test_unsupported_architecture_gguf(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model(path)


def test_unsupported_architecture_folder(tiny_llama, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'"):
        load_model(folder)


def test_unsupported_quant_type(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", {"attn_q": Q.TQ2_0}, hidden=256, intermediate=256)
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.attn_q\.weight' has type TQ2_0"):
        load_model(path)


def test_unknown_type_id(tmp_path):
    path = write_gguf(tmp_path / "u.gguf", {}, **SMALL)
    data = bytearray(path.read_bytes())
    # The tensor info of output_norm: name, n_dims=1, dim, then the type id (F32 = 0).
    name = b"output_norm.weight"
    at = data.index(name) + len(name) + 4 + 8
    assert data[at : at + 4] == (0).to_bytes(4, "little")
    data[at : at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="'output_norm.weight' has unknown type id 250"):
        load_model(path)


def test_missing_tensor(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(folder)


def test_shapes_no_family_runs_are_named(tiny_models, tmp_path):
    """A mixture choosing more experts than it has, a layer type no kernel has, a Gemma 3
    with softcapping: each refused, naming the setting."""
    cases = [
        ("qwen3moe", {"num_experts_per_tok": 9}, "9 experts per token of 8"),
        ("gpt-oss", {"layer_types": ["sliding_attention", "chunked"]}, "full or sliding"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping is set"),
    ]
    for arch, change, message in cases:
        folder = tmp_path / arch
        shutil.copytree(tiny_models[arch], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ModelLoadError, match=message):
            load_model(folder)


def test_gpt_oss_mxfp4_folders_point_to_the_gguf(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "oss"
    shutil.copytree(tiny_models["gpt-oss"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name + "_blocks"] = torch.zeros(8, 64, 2, 16, dtype=torch.uint8)
    tensors[name + "_scales"] = torch.zeros(8, 64, 2, dtype=torch.uint8)
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="MXFP4 blocks .* load the .gguf"):
        load_model(folder)


def test_cli_prints_one_line_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    proc = subprocess.run(
        [sys.executable, "-m", "lucedesk", "run", "-p", "hi", "--model", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lucedesk: error")]
    assert len(lines) == 1 and "bad.gguf" in lines[0]
    assert "Traceback" not in proc.stderr
