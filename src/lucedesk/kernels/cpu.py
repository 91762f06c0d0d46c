"""CPU kernels in C++ (`csrc/`): paged decode attention that reads KV blocks in place,
fused residual-add + RMSNorm, in-place rotary embedding, and weight-only int8 matmuls.

The source is compiled on first use with the machine's C++ compiler against the installed
torch (about 7 s), cached under the user cache directory keyed by source, torch version,
compiler flags and CPU, and loaded as `torch.ops.lucedesk_cpu`. Without a compiler,
`load_cpu_ops` raises `KernelUnavailable`, and the `auto` kernel choice falls back to torch.
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

from lucedesk.kernels.attention_torch import prefill_chunks
from lucedesk.kernels.checks import check_norm_args, check_rotary_args, require
from lucedesk.kernels.metadata import AttentionMetadata

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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


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
                _cpu_flags().encode(),
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


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    require(q.dim() == 3, f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    require(k_cache.dim() == 4, f"k_cache must be 4-D, got {tuple(k_cache.shape)}")
    require(k_cache.shape == v_cache.shape, "k_cache and v_cache differ in shape")
    require(
        q.dtype == k_cache.dtype == v_cache.dtype,
        f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}",
    )
    require(q.device.type == k_cache.device.type == "cpu", "the CPU kernels take CPU tensors only")
    require(q.shape[2] == k_cache.shape[3], "q and the cache differ in head_dim")
    require(q.shape[1] % k_cache.shape[0] == 0, "query heads must be a multiple of KV heads")
    require(q.stride(2) == 1, "q's head_dim must be contiguous")
    require(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")


def int8_tiles_available() -> bool:
    """Whether int8 weights run on AMX tiles here (their fast path)."""
    try:
        return bool(load_cpu_ops().int8_amx_available())
    except KernelUnavailable:
        return False


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `paged_attention_torch`: decode rows in C++ over the blocks in
    place; prompt chunks through torch's SDPA (compute-bound, where oneDNN's matmuls win)."""
    _check_inputs(q, k_cache, v_cache)
    require(q.shape[0] == meta.num_tokens, f"q has {q.shape[0]} rows, the step {meta.num_tokens}")
    require(window >= 0, f"window must be >= 0, got {window}")
    if sinks is not None:
        require(
            sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],),
            f"sinks must be float32 [{q.shape[1]}], got {sinks.dtype} {tuple(sinks.shape)}",
        )
        sinks = sinks.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    nd = meta.num_decodes
    if nd:
        load_cpu_ops().paged_decode_attention(
            out[:nd],
            q[:nd],
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            window,
            sinks,
        )
    prefill_chunks(q, k_cache, v_cache, meta, scale, out, window, sinks)
    return out


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual) * weight, x + residual)."""
    check_norm_args(x, residual, weight)
    return load_cpu_ops().add_rms_norm(x, residual, weight, eps)


def rotary_cpu(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, nh, hd] and k [T, kvh, hd] in place (views into a fused qkv are fine);
    cos/sin: [T, hd], each row's table entry."""
    check_rotary_args(q, k, cos, sin)
    load_cpu_ops().rotary_(q, k, cos, sin)
    return q, k


def quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """groups: [..., 32] float32 -> (q int8, d, m) with groups ~= d * q + m.

    Three grids are tried per group and the closest kept: min..max over all 256 levels
    (exact for Q4_1/Q4_K groups, whose extremes are levels 0 and 15), +-max|w| over
    +-127 (exact for Q8_0), and the max-magnitude value at level -128 (exact for Q4_0,
    whose scale puts it at -8 of 16 levels)."""
    low, high = groups.amin(-1), groups.amax(-1)
    peak = torch.where(high.abs() >= low.abs(), high, low)  # signed value of largest magnitude
    tiny = torch.finfo(torch.float32).tiny
    d_affine = ((high - low) / 255).clamp(min=tiny)
    candidates = [
        (d_affine, low + 128 * d_affine),
        ((peak.abs() / 127).clamp(min=tiny), torch.zeros_like(low)),
        (
            torch.where(peak < 0, 1.0, -1.0) * (peak.abs() / 128).clamp(min=tiny),
            torch.zeros_like(low),
        ),
    ]
    best = None
    for d, m in candidates:
        q = torch.round((groups - m[..., None]) / d[..., None]).clamp(-128, 127)
        err = (q * d[..., None] + m[..., None] - groups).abs().amax(-1)
        if best is None:
            best = [q, d, m, err]
        else:
            better = err < best[3]
            best = [
                torch.where(better[..., None], q, best[0]),
                torch.where(better, d, best[1]),
                torch.where(better, m, best[2]),
                torch.minimum(err, best[3]),
            ]
    return best[0].to(torch.int8), best[1], best[2]


class Int8Weight:
    """A [N, K] weight held as int8 with an affine scale per group of 32 inputs,
    w = d * q + m, q in [-128, 127], multiplied by bf16 activations in C++: on AMX tiles
    where the CPU has them (the values pre-arranged for the tiles), else in plain loops.

    Weights that came from a llama.cpp Q4_0/Q4_1/Q8_0/Q4_K file sit on such a grid already
    and come back exactly (to float rounding); any other group loses at most 1/510 of its
    range. Each row's result is independent of its batch."""

    GROUP = 32
    ROWS_AT_ONCE = 4096  # bounds the float copies while quantizing a big LM head

    @classmethod
    def fits(cls, shape: tuple[int, ...]) -> bool:
        """Whether a [N, K] weight runs on the fast path: whole groups, whole tiles."""
        n, k = shape
        return k % cls.GROUP == 0 and n % 16 == 0

    def __init__(self, weight: torch.Tensor) -> None:
        ops = load_cpu_ops()
        n, k = weight.shape
        require(k % self.GROUP == 0, f"int8 weights need inputs in groups of 32, got {k}")
        self.shape = (n, k)
        parts = [
            quantize_groups(rows.float().view(-1, k // self.GROUP, self.GROUP))
            for rows in weight.detach().split(self.ROWS_AT_ONCE)
        ]
        q, d, m = (torch.cat(t) for t in zip(*parts))
        self.tiles = int8_tiles_available() and n % 16 == 0
        if self.tiles:  # see csrc/int8.h: per 16 channels and 32 inputs, rows of input pairs
            q = q.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
            d = d.view(n // 16, 16, k // 32).transpose(1, 2)
            m = m.view(n // 16, 16, k // 32).transpose(1, 2)
        self.q = q.reshape(q.shape if self.tiles else (n, k)).contiguous()
        self.d, self.m = d.contiguous(), m.contiguous()
        self._matmul = ops.int8_linear_tiles if self.tiles else ops.int8_linear

    @property
    def nbytes(self) -> int:
        return self.q.numel() + (self.d.numel() + self.m.numel()) * 4

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernels see it: [N, K] float32 (d * q + m, before bf16)."""
        n, k = self.shape
        q, d, m = self.q.float(), self.d, self.m
        if self.tiles:
            q = q.permute(0, 3, 1, 2, 4).reshape(n, k // 32, 32)
            d, m = d.transpose(1, 2).reshape(n, -1), m.transpose(1, 2).reshape(n, -1)
        else:
            q = q.view(n, k // 32, 32)
        return (q * d[..., None] + m[..., None]).view(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] bfloat16 -> [M, N] bfloat16."""
        require(x.dtype == torch.bfloat16, f"int8 weights take bfloat16 inputs, got {x.dtype}")
        return self._matmul(x.contiguous(), self.q, self.d, self.m)


def lowbit_vector_available() -> bool:
    """Whether the 4/8-bit weight kernels run on AVX512-VNNI here (their fast path)."""
    try:
        return bool(load_cpu_ops().lowbit_vector_available())
    except KernelUnavailable:
        return False
