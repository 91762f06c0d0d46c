"""Every Triton kernel compiles for the GPUs lucedesk is for (gfx1201: the R9700; gfx1151:
the Strix Halo; sm_90), ahead of time and without one, with every specialization the
engine launches (kernels/launches.py: each dtype, head sizes 64/128/256, the block size,
8-bit KV or not, sinks, every held block type plain and gated), without a register spill
and within each target's LDS. Triton's interpreter runs kernels that do not compile for an
R9700 (tf32 precision does not exist there): this is where that shows."""

from __future__ import annotations

from lucedesk.kernels.compile_targets import TARGETS, compile_all


def test_every_kernel_compiles_for_every_target_without_spills():
    results = compile_all(list(TARGETS), workers=2)
    assert len({(r.kernel, r.label) for r in results}) >= 200
    failed = [f"{r.kernel} {r.label} on {r.target}: {'; '.join(r.problems)}" for r in results
              if not r.ok]  # fmt: skip
    assert not failed, "\n".join(failed)
    amd = [r for r in results if r.target != "sm_90" and r.kernel == "_attention_split_kernel"]
    assert all(r.matrix for r in amd if "float32" not in r.label)  # bf16/fp16 take WMMA


def test_a_precision_the_amd_targets_lack_is_a_failure_said():
    """The attention kernel as it was launched for bf16 (TF32 dots): refused on both AMD
    targets, taken on sm_90, and each result says so."""
    only = "_attention_split_kernel bfloat16 hd128 tile16"
    results = compile_all(list(TARGETS), only=only, constexprs={"PRECISION": "tf32"})
    by_target = {r.target: r for r in results if r.label.endswith("tile16")}
    assert not by_target["gfx1201"].ok and "tf32" in by_target["gfx1201"].error
    assert not by_target["gfx1151"].ok and "tf32" in by_target["gfx1151"].error
    assert by_target["sm_90"].ok
