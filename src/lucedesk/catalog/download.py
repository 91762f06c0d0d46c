"""One file of a Hugging Face repository into the hub's own cache, as huggingface_hub lays
it out (so the files are shared with every tool that reads that cache):

    <cache>/models--ORG--REPO/
        blobs/<sha256 of LFS files | git blob id of small ones>
        snapshots/<commit>/<path in the repository>  -> ../../blobs/<...>
        refs/main                                       (the commit main points at)

A transfer writes `blobs/<id>.incomplete`, kept when it is cut or interrupted: the next pull
asks for the rest with a Range request. The finished file is checked against the hub's
sha256 (git's blob hash for files outside LFS) before it takes its place; one that differs
is deleted and refused.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from lucedesk.errors import PullError

# (path in the repository, bytes done, bytes in all) after each chunk.
Transferred = Callable[[str, int, int], None]
CHUNK = 1 << 20
RETRIES = 5  # cut connections resumed in one pull, each after some bytes came or a pause


@dataclass(slots=True, frozen=True)
class RemoteFile:
    path: str  # in the repository
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git's blob hash (every file)

    @property
    def cache_id(self) -> str:
        """Its blob's name in the cache: huggingface_hub names LFS files by sha256."""
        name = self.sha256 or self.blob_id
        if not name:
            raise PullError(f"{self.path}: the hub gave no hash to check it against")
        return name


def transfer_text(path: str, done: int, total: int, rate: float | None = None) -> str:
    """A download's progress in words: `model.gguf: 1.2 GB of 18.6 GB (6%, 45.0 MB/s)`."""
    from lucedesk.catalog.quants import human_size

    speed = f", {human_size(int(rate))}/s" if rate is not None else ""
    return (
        f"{path.rpartition('/')[2]}: {human_size(done)} of {human_size(total)} "
        f"({done * 100 // max(total, 1)}%{speed})"
    )


def repo_folder(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


def snapshot_path(cache: Path, repo: str, commit: str, path: str) -> Path:
    return repo_folder(cache, repo) / "snapshots" / commit / path


def fetch_file(
    cache: Path,
    endpoint: str,
    headers: dict[str, str],
    repo: str,
    commit: str,
    file: RemoteFile,
    transferred: Transferred | None = None,
) -> Path:
    """The file's path in the cache's snapshot of `commit`, downloaded if missing."""
    from filelock import FileLock

    pointer = snapshot_path(cache, repo, commit, file.path)
    if pointer.exists():
        return pointer
    folder = repo_folder(cache, repo)
    blob = folder / "blobs" / file.cache_id
    lock = cache / ".locks" / folder.name / f"{file.cache_id}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):  # the same lock huggingface_hub takes for this blob
        if not blob.exists():
            url = f"{endpoint}/{repo}/resolve/{commit}/{quote(file.path)}"
            partial = blob.with_name(blob.name + ".incomplete")
            _transfer(url, headers, partial, file, transferred)
            _check(partial, file)
            partial.replace(blob)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _link(blob, pointer)
    return pointer


def _transfer(
    url: str, headers: dict, partial: Path, file: RemoteFile, transferred: Transferred | None
) -> None:
    """Bytes from the end of `partial` to the file's size, resuming after a cut."""
    import httpx

    failures = 0
    while True:
        done = partial.stat().st_size if partial.exists() else 0
        if done >= file.size:
            return
        ask = {**headers, "Range": f"bytes={done}-"} if done else headers
        try:
            with httpx.stream(
                "GET", url, headers=ask, follow_redirects=True, timeout=httpx.Timeout(30.0)
            ) as response:
                code = response.status_code
                if code == 429 or code >= 500:  # busy or down for now: tried again
                    raise Busy(f"the hub answered {code}")
                if code not in (200, 206):
                    raise PullError(_refusal(response, file.path))
                if code == 206 and not response.headers.get("content-range", "").startswith(
                    f"bytes {done}-"
                ):
                    raise Busy(f"the hub sent a range other than bytes {done}-")
                mode = "ab" if code == 206 else "wb"  # 200: the whole file, from the start
                got = done if mode == "ab" else 0
                with open(partial, mode) as out:
                    for chunk in response.iter_bytes():  # as it comes: a cut keeps all
                        if got + len(chunk) > file.size:
                            raise PullError(f"{file.path}: the hub sent over {file.size} bytes")
                        out.write(chunk)
                        got += len(chunk)
                        if transferred is not None:
                            transferred(file.path, got, file.size)
            if got > done:
                failures = 0
            if got < file.size:
                raise httpx.RemoteProtocolError("the server ended the file early")
        except (httpx.TransportError, httpx.DecodingError, Busy, OSError) as exc:
            if isinstance(exc, OSError) and not _network_error(exc):
                raise PullError(f"{partial}: cannot be written ({exc})") from None
            failures += 1
            if failures > RETRIES:
                raise PullError(
                    f"{file.path}: the download failed {failures} times ({exc}); "
                    f"{_size(partial)} kept, the next pull resumes there"
                ) from None
            time.sleep(min(2.0 ** (failures - 1), 8.0))


class Busy(Exception):
    """An answer worth asking again for: 429, 5xx, a range other than the one asked for."""


def _network_error(exc: OSError) -> bool:
    return isinstance(exc, (ConnectionError, TimeoutError))


def _size(path: Path) -> str:
    from lucedesk.catalog.quants import human_size

    return human_size(path.stat().st_size if path.exists() else 0)


def _refusal(response, path: str) -> str:
    code = response.status_code
    said = response.headers.get("X-Error-Message") or ""
    if response.headers.get("X-Error-Code") == "GatedRepo" or code in (401, 403):
        return (
            f"{path}: the hub refused it ({code}{': ' + said if said else ''}); a gated or "
            "private repository needs its terms accepted on its page and a token "
            "(HF_TOKEN=..., or `hf auth login`)"
        )
    return f"{path}: the hub answered {code}{': ' + said if said else ''}"


def _check(partial: Path, file: RemoteFile) -> None:
    """The finished file's sha256 (or git blob hash) against the hub's; deleted if it differs."""
    if file.sha256:
        digest, want, kind = hashlib.sha256(), file.sha256, "sha256"
    else:
        digest, want, kind = hashlib.sha1(), file.blob_id, "git blob hash"
        digest.update(b"blob %d\0" % partial.stat().st_size)
    with open(partial, "rb") as f:
        while chunk := f.read(CHUNK * 8):
            digest.update(chunk)
    if digest.hexdigest() != want:
        partial.unlink()
        raise PullError(
            f"{file.path}: its {kind} {digest.hexdigest()[:16]}... differs from the hub's "
            f"{want[:16]}...; the download was deleted"
        )


def _link(blob: Path, pointer: Path) -> None:
    """The snapshot entry: a relative link to the blob where links work, else a copy."""
    if pointer.exists() or pointer.is_symlink():
        pointer.unlink()
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:
        import shutil

        shutil.copyfile(blob, pointer)


def write_ref(cache: Path, repo: str, revision: str, commit: str) -> None:
    """refs/<revision> names the commit, as huggingface_hub records a branch's."""
    if revision == commit:
        return
    ref = repo_folder(cache, repo) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)
