"""The CPU's instruction sets, as the C++ kernels meet them: its feature flags, and the fast
paths a build for this machine gets. No torch here: the fit (catalog/) asks before anything
is loaded, the kernels' build (kernels/cpu_build.py) when it compiles."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86 "flags", Arm "Features"),
    else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_paths_from_flags(flags: str) -> frozenset[str]:
    """The C++ kernels' fast paths a CPU with these flags gets (they are built for the
    machine they run on): "vnni" (AVX512-VNNI) and "amx" (AMX int8 tiles)."""
    have = set(flags.split())
    paths = set()
    if {"avx512f", "avx512bw", "avx512_vnni"} <= have:
        paths.add("vnni")
    if {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"} <= have:  # as the build needs
        paths.add("amx")
    return frozenset(paths)
