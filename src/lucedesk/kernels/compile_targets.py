"""Every Triton kernel compiled ahead of time for the GPUs lucedesk is for, with the
specializations the engine launches, and what each became: registers, spills, LDS (shared
memory) and the matrix instructions chosen. Triton's wheel does this without a GPU.

    targets     gfx1201 (R9700, RDNA4) and gfx1151 (Strix Halo, RDNA3.5), wave32; sm_90
    failures    a compile error, a register spill, LDS over the target's limit

Each specialization's constexprs come from the wrapper's own function for them (the one its
launch calls), so what is compiled here is what runs. tests/test_compile_targets.py runs
all of it; `bench/compile_targets.py` prints the table.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton

from lucedesk.kernels.launches import Specialization, all_launches

TARGETS = {
    "gfx1201": ("hip", "gfx1201", 32),
    "gfx1151": ("hip", "gfx1151", 32),
    "sm_90": ("cuda", 90, 32),
}
LDS_LIMIT = {"gfx1201": 64 << 10, "gfx1151": 64 << 10, "sm_90": 227 << 10}


@dataclass(slots=True)
class Compiled:
    kernel: str
    label: str
    target: str
    registers: int = 0  # VGPRs (AMD) or registers a thread (NVIDIA)
    spills: int = 0  # values spilled to scratch (AMD) or bytes of local memory (NVIDIA)
    lds: int = 0  # shared memory bytes
    matrix: tuple[str, ...] = ()  # WMMA / MMA instructions used
    error: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def compile_one(spec: Specialization, target: str) -> Compiled:
    """One specialization for one target (a compile error is the result's, not raised)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = Compiled(spec.name, spec.label, target)
    index = {name: i for i, name in enumerate(spec.kernel.arg_names)}
    constexprs = {(index[k],): v for k, v in spec.constexprs.items()}
    source = ASTSource(fn=spec.kernel, signature=spec.signature(), constexprs=constexprs)
    try:
        options = {"num_warps": spec.num_warps}
        compiled = triton.compile(source, target=GPUTarget(*TARGETS[target]), options=options)
    except Exception as exc:  # what the target refuses: the test's failure, said in full
        result.error = " ".join(f"{type(exc).__name__}: {exc}".split())[-600:]
        result.problems.append(f"does not compile: {result.error}")
        return result
    result.lds = int(compiled.metadata.shared)
    if TARGETS[target][0] == "hip":
        _read_amdgcn(compiled.asm["amdgcn"], result)
    else:
        _read_cubin(compiled.asm["cubin"], compiled.asm["ptx"], result)
    if result.spills:
        result.problems.append(f"spills {result.spills}")
    if result.lds > LDS_LIMIT[target]:
        result.problems.append(f"LDS {result.lds} B over the target's {LDS_LIMIT[target]}")
    return result


def _field(text: str, name: str) -> int:
    found = re.search(rf"\.{name}:\s+(\d+)", text)
    return int(found[1]) if found else 0


def _read_amdgcn(text: str, result: Compiled) -> None:
    result.registers = _field(text, "vgpr_count")
    result.spills = _field(text, "vgpr_spill_count") + _field(text, "sgpr_spill_count")
    scratch = re.search(r"ScratchSize:\s+(\d+)", text)
    if scratch and int(scratch[1]) and not result.spills:
        result.spills = int(scratch[1])  # private memory used otherwise: as bad
    result.matrix = tuple(sorted(set(re.findall(r"\bv_wmma_\w+", text))))


def _read_cubin(cubin: bytes, ptx: str, result: Compiled) -> None:
    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    result.registers = int(re.search(r"REG:(\d+)", usage)[1])
    result.spills = int(re.search(r"LOCAL:(\d+)", usage)[1])
    result.matrix = tuple(sorted(set(re.findall(r"\b(wgmma\.\w+|mma\.sync\.\w+)", ptx))))


def compile_all(
    targets: list[str],
    quick: bool = False,
    workers: int = 1,
    only: str | None = None,
    constexprs: dict | None = None,
) -> list[Compiled]:
    """Every launch (kernels/launches.py) for every target, compiled in `workers` fresh
    processes (each compile is a core's work for a fraction of a second to seconds; and a
    process whose kernels run in Triton's interpreter cannot compile them). `only`: the
    launches whose kernel and label start so; `constexprs`: changed in each, for a test."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    names = [f"{s.name} {s.label}" for s in _launches(quick, False)]
    jobs = [(i, t, quick, constexprs) for i, name in enumerate(names) for t in targets
            if only is None or name.startswith(only)]  # fmt: skip
    context = multiprocessing.get_context("spawn")
    said = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # the workers' kernels defined for the compiler
    try:
        with ProcessPoolExecutor(max(workers, 1), context) as pool:
            return list(pool.map(_compile_job, jobs, chunksize=4))
    finally:
        if said is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = said


def _compile_job(job: tuple[int, str, bool, dict | None]) -> Compiled:
    index, target, quick, constexprs = job
    spec = _launches(quick, True)[index]
    if constexprs:
        spec = dataclasses.replace(spec, constexprs=spec.constexprs | constexprs)
    return compile_one(spec, target)


@functools.cache
def _launches(quick: bool, worker: bool) -> list[Specialization]:
    """The launches, listed once a process (`worker`: a compiling one's)."""
    return list(all_launches(quick))
