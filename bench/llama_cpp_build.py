"""llama.cpp's tools for the peer benchmarks (bench/llama_cpp_peer.py, bench/moe_peer.py):
`llama-server` and `llama-quantize` built once from the llama.cpp that the pinned
llama-cpp-python sdist vendors (fetched with pip; about ten minutes on two cores) and kept,
with its `convert_hf_to_gguf.py` and the modules it imports, under the user cache folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import platformdirs

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp 0c1e57098 (and that commit's git data)
CMAKE_FLAGS = [
    *"-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF".split(),  # one self-contained binary
    # No downloads at build time (the web UI would be one) and nothing but the server.
    *"-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF".split(),
    *"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF".split(),
    *"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON".split(),
    *"-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON".split(),
    # A native build crashed in llama.cpp's AMX matmul on the development machine.
    *"-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF".split(),
]
TOOLS = ("llama-server", "llama-quantize")  # the targets built


def say(message: str) -> None:
    print(f"llama_cpp_peer: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("lucedesk")) / "llama.cpp" / LLAMA_CPP_PYTHON


def find_llama_server(given: str | None) -> Path:
    """`--llama-server`, else PATH, else the cached build, else a fresh build into the cache."""
    if given:
        path = Path(given).expanduser()
        if not os.access(path, os.X_OK):
            raise SystemExit(f"--llama-server {given}: not an executable file")
        return path
    if on_path := shutil.which("llama-server"):
        return Path(on_path)
    cached = cache_dir() / "llama-server"
    if os.access(cached, os.X_OK):
        return cached
    return build_llama_tools(cache_dir())["server"]


def tool_paths(folder: Path) -> dict[str, Path]:
    return {
        "server": folder / "llama-server",
        "quantize": folder / "llama-quantize",
        "converter": folder / "converter" / "convert_hf_to_gguf.py",
    }


def find_llama_tools() -> dict[str, Path]:
    """The cached llama-server, llama-quantize and convert_hf_to_gguf.py (with the modules
    and gguf-py it imports), built and kept on first use."""
    cached = tool_paths(cache_dir())
    if all(path.exists() for path in cached.values()):
        return cached
    return build_llama_tools(cache_dir())


def build_llama_tools(target: Path) -> dict[str, Path]:
    """Fetch the llama-cpp-python sdist with pip, build its vendored llama.cpp's server and
    quantizer with CMAKE_FLAGS and keep the binaries, the converter and a record of the
    build in `target`."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lucedesk-llama-cpp-") as tmp:
        source = unpack(download_sdist(Path(tmp)), Path(tmp)) / "vendor" / "llama.cpp"
        commit = vendored_commit(source)
        say(f"building llama-server from llama.cpp {commit} (this takes several minutes)")
        built = cmake_build(source, Path(tmp) / "build")
        target.mkdir(parents=True, exist_ok=True)
        for binary in TOOLS:
            partial = target / f"{binary}.partial"
            shutil.copy2(built / binary, partial)
            partial.replace(target / binary)
        converter = target / "converter"
        shutil.rmtree(converter, ignore_errors=True)
        converter.mkdir()
        shutil.copy2(source / "convert_hf_to_gguf.py", converter)
        for folder in ("conversion", "gguf-py"):
            if (source / folder).is_dir():
                shutil.copytree(source / folder, converter / folder)
    record = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "llama_cpp_commit": commit,
        "cmake_flags": CMAKE_FLAGS,
        "build_seconds": round(time.monotonic() - started),
        "built": time.strftime("%Y-%m-%d"),
    }
    (target / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    say(f"llama-server built in {record['build_seconds']} s, cached in {target}")
    return tool_paths(target)


def download_sdist(folder: Path) -> Path:
    requirement = f"llama-cpp-python=={LLAMA_CPP_PYTHON}"
    say(f"downloading the {requirement} sdist with pip (~75 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "-d", str(folder), requirement]
    subprocess.run(cmd, stdout=sys.stderr, check=True)
    sdists = list(folder.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise SystemExit(f"pip downloaded no sdist for {requirement}")
    return sdists[0]


def unpack(sdist: Path, folder: Path) -> Path:
    say(f"unpacking {sdist.name}")
    with tarfile.open(sdist) as tar:
        tar.extractall(folder, filter="data")
    return folder / sdist.name.removesuffix(".tar.gz")


def vendored_commit(source: Path) -> str:
    """The vendored llama.cpp's commit: the sdist carries its git data; failing that, the
    newest `llama.cpp@<sha>` in the package's changelog."""
    git = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if git.returncode == 0 and git.stdout.strip():
        return git.stdout.strip()
    changelog = source.parents[1] / "CHANGELOG.md"
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", changelog.read_text(errors="replace"))
    return found.group(1) if found else "unknown"


def cmake_build(source: Path, build: Path) -> Path:
    """Configure with Ninja and build the TOOLS targets only -> the folder they are in."""
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS],
        stdout=sys.stderr,
        check=True,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", *TOOLS], stdout=sys.stderr, check=True
    )
    return build / "bin"


def describe_llama_server(binary: Path) -> dict:
    """What the docs say of the binary: its build record if this script built it, and the
    version line it reports either way."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    record_path = binary.parent / "build.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    version = " ".join(line.strip() for line in lines[-2:]).removeprefix("version: ")
    return {"version": version, **record}
