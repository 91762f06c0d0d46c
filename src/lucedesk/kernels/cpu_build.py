"""Building the C++ CPU kernels (`csrc/`) and loading them as `torch.ops.lucedesk_cpu`.

The source is compiled on first use with the machine's C++ compiler against the installed
torch (about 7 s), cached under the user cache directory keyed by source, torch version,
compiler flags and CPU, and loaded once per process. Without a compiler, `load_cpu_ops`
raises `KernelUnavailable`, and the `auto` kernel choice falls back to torch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lucedesk.isa import cpu_flags

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
SOURCE = SOURCES / "ops.cpp"  # includes the headers beside it
# -ffp-contract=off: no fused multiply-adds, so the rotary and the residual add round exactly
# where the torch reference does. Reassociation is allowed (sums and dot products reduce in
# vector registers, in a fixed order that does not depend on the batch).
# Tuned for the machine it is built on: x86-64 with 512-bit vectors where it has them
# (AVX-512, AVX512-BF16 and AMX paths switch on by what the compiler sees), Arm by -mcpu.
X86 = platform.machine().lower() in ("x86_64", "amd64")
CXXFLAGS = [
    "-O3",
    *(["-march=native", "-mprefer-vector-width=512"] if X86 else ["-mcpu=native"]),
    "-fno-math-errno",
    "-ffp-contract=off",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fopenmp",
    "-std=c++17",
    "-fPIC",
]


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here (no compiler, a failed build)."""


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    root = os.environ.get("LUCEDESK_KERNEL_CACHE") or user_cache_dir("lucedesk")
    return Path(root) / "kernels"


def _build_command(compiler: str, source: Path, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, *CXXFLAGS, "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{p}" for p in include_paths()]
    cmd += [str(source), "-o", str(output)]
    for lib in library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return cmd + ["-lc10", "-ltorch_cpu"]


def find_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def library_path() -> Path | None:
    """Where this machine's build of the kernels lives (whether built yet or not); None
    without a compiler."""
    compiler = find_compiler()
    if compiler is None:
        return None
    source = b"".join(p.read_bytes() for p in sorted(SOURCES.iterdir()) if p.is_file())
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                torch.__version__.encode(),
                " ".join(CXXFLAGS).encode(),
                compiler.encode(),
                cpu_flags().encode(),
                sys.version.encode(),
            ]
        )
    ).hexdigest()[:16]
    return cache_dir() / f"lucedesk_cpu_ops-{key}.so"


def needs_build() -> bool:
    """True when the next `load_cpu_ops` will compile (the first run on this machine)."""
    library = library_path()
    return library is not None and not library.exists()


@functools.cache
def load_cpu_ops() -> object:
    """Build (once per machine and torch version) and load the kernels; returns
    `torch.ops.lucedesk_cpu`. Process-wide: a torch op library registers only once."""
    library = library_path()
    if library is None:
        raise KernelUnavailable("no C++ compiler found (set CXX or install g++)")
    compiler = find_compiler()
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        log.info("building CPU kernels (first run on this machine, ~10 s)")
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            partial = Path(tmp) / library.name
            result = subprocess.run(
                _build_command(compiler, SOURCE, partial), capture_output=True, text=True
            )
            if result.returncode != 0:
                lines = result.stderr.strip().splitlines()
                errors = [line for line in lines if "error" in line] or lines[-12:]
                raise KernelUnavailable(
                    "building the CPU kernels failed:\n" + "\n".join(errors[:12])
                )
            os.replace(partial, library)  # atomic: a concurrent build never sees half a file
        for old in library.parent.glob("lucedesk_cpu_ops-*.so"):
            if old != library:  # builds of earlier sources or torch versions
                old.unlink(missing_ok=True)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        raise KernelUnavailable(f"loading {library} failed: {exc}") from None
    return torch.ops.lucedesk_cpu
