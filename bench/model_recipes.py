"""Which quant `lucedesk pull ORG/REPO` (or `--model ORG/REPO`) takes for four models a
Strix Halo or R9700 owner wants, under each profile, and what it needs: computed with the
same code a pull runs (catalog/quants.py's choice, catalog/fit.py's estimate) from the
repositories' published file sizes and the models' shapes below.

    .venv/bin/python bench/model_recipes.py [--write-docs]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lucedesk import profile
from lucedesk.catalog.fit import Fit
from lucedesk.catalog.quants import Quant, choose_quant, label_type
from lucedesk.catalog.summary import ModelSummary

DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"
SECTION = "## What each profile takes of four larger models"
GB = 10**9
GIB = 2**30

# (repository, shape, {quant: published size in bytes})
MODELS = [
    (
        "unsloth/Qwen3-30B-A3B-GGUF",
        dict(architecture="qwen3moe", params=30_532_000_000, context=40960, num_layers=48,
             num_kv_heads=4, head_dim=128, vocab_size=151936, hidden_size=2048,
             tied_embeddings=False),
        {"Q4_K_M": 18.6 * GB, "Q5_K_M": 21.7 * GB, "Q6_K": 25.1 * GB, "Q8_0": 32.5 * GB,
         "BF16": 61.1 * GB},
    ),
    (
        "ggml-org/gpt-oss-20b-GGUF",
        dict(architecture="gpt-oss", params=20_914_000_000, context=131072, num_layers=24,
             num_kv_heads=8, head_dim=64, vocab_size=201088, hidden_size=2880,
             tied_embeddings=False),
        {"MXFP4": 12.1 * GB},
    ),
    (
        "ggml-org/gpt-oss-120b-GGUF",
        dict(architecture="gpt-oss", params=116_829_000_000, context=131072, num_layers=36,
             num_kv_heads=8, head_dim=64, vocab_size=201088, hidden_size=2880,
             tied_embeddings=False),
        {"MXFP4": 63.4 * GB},  # three parts (-00001-of-00003.gguf ...)
    ),
    (
        "unsloth/gemma-3-27b-it-GGUF",
        dict(architecture="gemma3", params=27_009_000_000, context=131072, num_layers=62,
             num_kv_heads=16, head_dim=128, vocab_size=262208, hidden_size=5376,
             tied_embeddings=True),
        {"Q4_K_M": 16.5 * GB, "Q5_K_M": 19.3 * GB, "Q6_K": 22.2 * GB, "Q8_0": 28.7 * GB,
         "BF16": 54.0 * GB},
    ),
]  # fmt: skip

# (profile, device, memory free to it when nothing runs, the C++ kernels' paths on its CPU)
VNNI = frozenset({"vnni"})  # Zen 5 (the Strix Halo's cores) and other AVX512-VNNI CPUs
MACHINES = [
    ("r9700", "cuda", 31 * GIB, None, "R9700 (32 GB; 31 GiB free)"),
    ("strix-halo", "cuda", 96 * GIB, None, "Strix Halo (96 GiB given to the GPU)"),
    ("cpu", "cpu", 110 * GIB, VNNI, "Strix Halo, `--profile cpu` (110 GiB free)"),
    ("cpu", "cpu", 56 * GIB, VNNI, "a CPU with 64 GB and AVX512-VNNI (56 GiB free)"),
]


def summary(shape: dict, label: str, size: float) -> ModelSummary:
    """A quant known by its label and size (no tensor table): its weights in the label's
    type, as many as its size holds (ModelSummary.matmuls)."""
    kind = label_type(label)
    return ModelSummary(
        **shape, quant=label, size_bytes=int(size), mlp_type=kind, embedding_type=kind
    )


def cell(name: str, device: str, free: int, paths, shape: dict, sizes: dict) -> str:
    _, config, _ = profile.resolve(name)
    fit = Fit(config, device, "bfloat16", free, cpu_paths=paths)
    quants = [Quant(label, (f"x-{label}.gguf",), int(size)) for label, size in sizes.items()]
    quants.sort(key=lambda q: q.size)
    chosen = choose_quant(quants, lambda q: fit(summary(shape, q.label, q.size)))
    need = fit.need(summary(shape, chosen.label, chosen.size))
    fits = need.total <= free
    what = (
        f"{need.total / GIB:.1f} GiB: {need.weights / GIB:.1f} weights ({need.weight_format}), "
        f"{need.kv / GIB:.1f} KV ({need.kv_tokens:,} tokens)"
    )
    return f"**{chosen.label}**, {what}" if fits else f"none fits ({chosen.label} needs {what})"


def table() -> str:
    lines = [
        "| model | " + " | ".join(m[4] for m in MACHINES) + " |",
        "| --- |" + " --- |" * len(MACHINES),
    ]
    for repo, shape, sizes in MODELS:
        cells = [cell(p, d, free, paths, shape, sizes) for p, d, free, paths, _ in MACHINES]
        lines.append(f"| `{repo}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help=f"update '{SECTION}'")
    args = parser.parse_args()
    report = table()
    print(report)
    if args.write_docs:
        from llama_cpp_peer import replace_section

        text = DOCS.read_text()
        start = text.index(SECTION)
        intro_end = text.index("\n| model |", start)
        section = text[start:intro_end] + "\n" + report + "\n"
        DOCS.write_text(replace_section(text, section))
        print(f"wrote '{SECTION}' in {DOCS}", file=sys.stderr)


if __name__ == "__main__":
    main()
