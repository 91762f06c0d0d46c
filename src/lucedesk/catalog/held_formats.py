"""How the engine holds a model's matmul weights: one rule, asked by every part that needs
it: the fit (catalog/fit.py) before a model loads, the loader (engine/build.py) as it loads,
the weight cache and `lucedesk profiles`. No torch here.

A held format takes some GGUF block types as the file holds them (their bytes reordered for
its kernels, never widened) and holds every other weight one way of its own:

    weights  kernels  held as the file's blocks                  any other weight
    q4       cpu      Q4_0 Q4_1 Q4_K MXFP4 IQ4_NL IQ4_XS at 4    8-bit levels of its values
                      bits, Q5_0 Q5_1 Q8_0 at 8, Q6_K at 6
    int8     cpu      Q8_0 (other level types at 8 bits)         8-bit levels of its values
    q4       triton   every type lucedesk reads but the floats   Q8_0 blocks
    int8     triton   Q8_0                                       Q8_0 blocks

`auto` takes, on the C++ kernels with a bfloat16 model and a fast path for them on this CPU,
q4 for a file whose first MLP weights are 4- or 5-bit, else int8; on the Triton kernels q4
for any quantized GGUF file; else the model dtype. A new held format is one module (its
weights, named by `module`) and one line in FORMATS.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lucedesk.errors import ConfigError

# The GGUF tensor types lucedesk reads: dequantized, or held as they are.
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = (
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_NL", "IQ4_XS",
)  # fmt: skip
READ_TYPES = (*FLOAT_TYPES, *BLOCK_TYPES)
# 4- and 5-bit types: a file whose MLP is in one of these is what `auto` holds as q4 on a CPU.
LOW_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "MXFP4", "IQ4_NL", "IQ4_XS")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@functools.cache
def block_shape(type_name: str) -> tuple[int, int]:
    """(values, bytes) of one block of a GGUF type, as llama.cpp lays it out."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def file_bytes(type_name: str, numel: int) -> int:
    """Bytes `numel` values of a GGUF type take in its file."""
    values, size = block_shape(type_name)
    return numel // values * size


def gpu_bytes_per_weight(type_name: str) -> float:
    """A GGUF type as the Triton kernels hold it (kernels/blocks.py): its levels packed in
    planes (4 bits, plus 1 or 2 high bits, or 8), its scales one byte or two each: the
    file's size, but where llama.cpp packs a K-quant's 6-bit scales (12 bytes for eight
    groups' scales and mins) they are a byte each (16)."""
    bits = {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}.get(type_name, 4)
    # (bytes a scale, groups a scale covers; then the same for super-block scales of 256)
    scales = {
        "Q4_0": 2 / 32, "Q4_1": 4 / 32, "Q5_0": 2 / 32, "Q5_1": 4 / 32, "Q8_0": 2 / 32,
        "Q4_K": 2 / 32 + 4 / 256, "Q5_K": 2 / 32 + 4 / 256, "Q6_K": 1 / 16 + 2 / 256,
        "MXFP4": 1 / 32, "IQ4_NL": 2 / 32, "IQ4_XS": 1 / 32 + 2 / 256,
    }  # fmt: skip
    return bits / 8 + scales[type_name]


@dataclass(frozen=True, slots=True)
class HeldFormat:
    """One way of holding a model's matmul weights."""

    name: str  # the `weights` setting that names it
    kernels: str  # the kernels that multiply it
    module: str  # where its weights are made (engine/build.py imports `make_projection` etc.)
    takes: Mapping[str, float]  # GGUF types held as the file has them -> bytes a weight held
    other: float  # bytes a weight of any other type (or a float weight) takes
    dtypes: tuple[str, ...]  # the model dtypes its kernels take activations in
    cpu_paths: tuple[str, ...] = ()  # CPU kernel paths one of which makes it fast (auto)
    embedding: bool = False  # the embedding table held too (a tied LM head then is that)
    channels: int = 1  # the outputs a weight's N must be a multiple of (inputs: of 32)
    description: str = ""

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a [..., N, K] weight takes this format (whole groups of 32 inputs)."""
        n, k = shape[-2:]
        return k % 32 == 0 and n % self.channels == 0

    def bytes_for(self, type_name: str, numel: int) -> int:
        """Bytes `numel` weights of a GGUF type (or a float type) take held."""
        return int(numel * self.takes.get(type_name, self.other))

    def holds_as_is(self, type_name: str) -> bool:
        return type_name in self.takes


_CPU_Q4 = {
    "Q4_0": 0.5625, "Q4_1": 0.625, "Q4_K": 0.59375, "MXFP4": 0.53125, "IQ4_NL": 0.625,
    "IQ4_XS": 0.75, "Q5_0": 1.125, "Q5_1": 1.125, "Q8_0": 1.0625, "Q6_K": 0.828125,
}  # fmt: skip
_CPU_INT8 = {
    "Q8_0": 1.0625, "Q4_0": 1.125, "Q4_1": 1.125, "Q5_0": 1.125, "Q5_1": 1.125, "Q4_K": 1.09375,
}  # fmt: skip

FORMATS: dict[tuple[str, str], HeldFormat] = {
    (f.name, f.kernels): f
    for f in (
        HeldFormat(
            "q4", "cpu", "lucedesk.engine.formats.cpu_levels", _CPU_Q4, 1.25, ("bfloat16",),
            ("vnni",), channels=16,
            description="the file's 4-, 6- and 8-bit levels, C++ (AVX512-VNNI)",
        ),
        HeldFormat(
            "int8", "cpu", "lucedesk.engine.formats.cpu_levels", _CPU_INT8, 1.25, ("bfloat16",),
            ("vnni", "amx"), channels=16,
            description="8-bit levels, C++ (AVX512-VNNI or AMX tiles)",
        ),
        HeldFormat(
            "q4", "triton", "lucedesk.engine.formats.gpu_blocks",
            {t: gpu_bytes_per_weight(t) for t in BLOCK_TYPES}, gpu_bytes_per_weight("Q8_0"),
            ("bfloat16", "float16", "float32"), embedding=True,
            description="the file's blocks, Triton (others as Q8_0)",
        ),
        HeldFormat(
            "int8", "triton", "lucedesk.engine.formats.gpu_blocks",
            {"Q8_0": gpu_bytes_per_weight("Q8_0")}, gpu_bytes_per_weight("Q8_0"),
            ("bfloat16", "float16", "float32"), embedding=True,
            description="every weight as Q8_0 blocks, Triton",
        ),
    )
}  # fmt: skip


def choose(
    wanted: str, kernels: str, dtype: str, mlp_type: str, cpu_paths: Iterable[str] = ()
) -> HeldFormat | None:
    """The format the weights take (None: every weight in the model dtype) for the
    `weights` setting `wanted` on `kernels`, a model in `dtype` whose first layer's MLP
    weights (its experts' in a mixture) are of GGUF type `mlp_type` ("" where the file is
    not a GGUF), on a CPU with these C++ kernel paths. A named format that cannot hold these
    weights is refused, saying why."""
    if wanted == "dtype":
        return None
    paths = set(cpu_paths)
    if wanted == "auto":
        if kernels == "triton":
            return FORMATS["q4", "triton"] if mlp_type in BLOCK_TYPES else None
        if kernels != "cpu" or dtype != "bfloat16":
            return None
        q4, int8 = FORMATS["q4", "cpu"], FORMATS["int8", "cpu"]
        if mlp_type in LOW_BIT_TYPES and paths & set(q4.cpu_paths):
            return q4
        return int8 if paths & set(int8.cpu_paths) else None
    held = FORMATS.get((wanted, kernels))
    if held is None:
        where = ", ".join(f"{k} kernels" for w, k in FORMATS if w == wanted)
        raise ConfigError(f"weights {wanted!r} run on the {where}, not on the {kernels} kernels")
    if dtype not in held.dtypes:
        raise ConfigError(
            f"weights {wanted!r} on the {kernels} kernels need a {' or '.join(held.dtypes)} "
            f"model (dtype {dtype})"
        )
    if wanted == "q4" and kernels == "cpu" and mlp_type not in LOW_BIT_TYPES:
        raise ConfigError(
            "weights 'q4' need a GGUF file whose projections are in a 4- or 5-bit type "
            f"({', '.join(LOW_BIT_TYPES)}); this model's are {mlp_type or 'not from a GGUF file'}"
        )
    return held


def held_bytes(
    held: HeldFormat | None,
    dtype: str,
    params: int,
    matmuls: Mapping[str, int],
    embedding: tuple[str, int],
    tied: bool,
) -> int:
    """The weights' bytes as `held` holds them (None: all `params` in `dtype`): the matmul
    weights (`matmuls`: numel by GGUF type, the LM head among them unless `tied`), the
    embedding table (`embedding`: its type and numel) held with them or in the dtype, a
    tied LM head a second copy of it where the embedding is not held, and every other
    parameter (norms, biases, routers) in the dtype."""
    width = DTYPE_BYTES[dtype]
    if held is None:
        return params * width
    kind, count = embedding
    total = sum(held.bytes_for(t, n) for t, n in matmuls.items())
    rest = params - sum(matmuls.values()) - count
    if held.embedding:
        total += held.bytes_for(kind, count)
    else:
        total += count * width + (held.bytes_for(kind, count) if tied else 0)
    return total + max(rest, 0) * width
