"""Hugging Face repositories through huggingface_hub: what one holds (its commit, each file's
size and hash), a GGUF header read from a file's first bytes, and the cache's copy.

Read at each call, as huggingface_hub reads them: HF_ENDPOINT (a mirror), HF_HUB_OFFLINE
(nothing asked of the network), HF_TOKEN or the token `hf auth login` saved (gated and
private repositories), HF_HUB_CACHE / HF_HOME (where files go)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from lucedesk import __version__
from lucedesk.catalog.download import RemoteFile, repo_folder
from lucedesk.catalog.gguf_header import Header, Truncated, parse_header
from lucedesk.errors import PullError

DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass(slots=True)
class Listing:
    repo: str
    commit: str
    files: list[RemoteFile]
    cached: bool = False  # read from the cache (offline), not from the hub

    def file(self, path: str) -> RemoteFile | None:
        return next((f for f in self.files if f.path == path), None)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "on", "yes", "true")


def cache_dir() -> Path:
    """Where huggingface_hub keeps repositories (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    return Path(home).expanduser() / "hub"


def headers() -> dict[str, str]:
    """The user agent, and the user's token where there is one."""
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(library_name="lucedesk", library_version=__version__)


def list_repo(repo: str, revision: str = "main") -> Listing:
    """The repository's commit and files (sizes, sha256 of LFS files) as the hub says."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if offline():
        raise PullError(f"{repo}: HF_HUB_OFFLINE is set and the cache holds no copy of it")
    where = endpoint()
    api = HfApi(endpoint=where, library_name="lucedesk", library_version=__version__)
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except GatedRepoError:
        raise PullError(_gated(repo, where)) from None
    except RepositoryNotFoundError:
        raise PullError(
            f"{repo}: no such repository on {where} (a private one needs a token: "
            "HF_TOKEN=..., or `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise PullError(f"{repo}: has no revision {revision!r}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise PullError(f"{repo}: {where} answered {status}") from None
    except Exception as exc:  # the transport's own errors differ between library versions
        raise PullError(
            f"cannot reach {where} ({type(exc).__name__}: {exc}); with HF_HUB_OFFLINE=1 "
            "lucedesk uses what is already downloaded"
        ) from None
    files = [
        RemoteFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings or []
    ]
    return Listing(repo, str(info.sha), files)


def _gated(repo: str, where: str) -> str:
    return (
        f"{repo} is gated: accept its terms on {where}/{repo} and give lucedesk a token "
        "(HF_TOKEN=..., or `hf auth login`)"
    )


def cached_listing(repo: str, revision: str = "main") -> Listing | None:
    """What the cache holds of the repository at `revision` (the snapshot its ref names,
    else the newest snapshot), or None."""
    folder = repo_folder(cache_dir(), repo)
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else None
    snapshots = folder / "snapshots"
    if commit is None or not (snapshots / commit).is_dir():
        found = (
            sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime)
            if snapshots.is_dir()
            else []
        )
        if not found:
            return None
        commit = found[-1].name
    root = snapshots / commit
    files = [
        RemoteFile(p.relative_to(root).as_posix(), p.stat().st_size, None, None)
        for p in sorted(root.rglob("*"))
        if p.is_file()  # a link to a blob that is there
    ]
    return Listing(repo, commit, files, cached=True)


def read_remote_header(listing: Listing, file: RemoteFile, first_bytes: int = 4 << 20) -> Header:
    """A GGUF file's header from its first bytes (more while the header runs on)."""
    import httpx

    url = f"{endpoint()}/{listing.repo}/resolve/{listing.commit}/{quote(file.path)}"
    while True:
        want = min(first_bytes, file.size)
        buf = bytearray()
        try:  # streamed: a server that ignores the Range sends no more than is read
            with httpx.stream(
                "GET",
                url,
                headers={**headers(), "Range": f"bytes=0-{want - 1}"},
                follow_redirects=True,
                timeout=30.0,
            ) as response:
                if response.status_code in (401, 403):
                    raise PullError(_gated(listing.repo, endpoint()))
                if response.status_code not in (200, 206):
                    raise PullError(f"{file.path}: the hub answered {response.status_code}")
                for chunk in response.iter_bytes(1 << 20):
                    buf += chunk
                    if len(buf) >= want:
                        break
        except httpx.HTTPError as exc:
            raise PullError(f"{file.path}: cannot read its header ({exc})") from None
        try:
            return parse_header(bytes(buf[:want]), file.path, file.size)
        except Truncated:
            if want >= file.size or first_bytes >= 256 << 20:
                raise
            first_bytes *= 4
