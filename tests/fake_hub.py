"""A Hugging Face hub on a local socket, answering the endpoints huggingface_hub and lucedesk
call, as the hub answers them:

    GET  /api/models/ORG/REPO[/revision/REV]?blobs=true   commit, files, sizes, LFS sha256
    HEAD|GET /ORG/REPO/resolve/REV/PATH                    small files: 200, ETag = git blob
                                                           id; LFS files: 302 to the CDN,
                                                           X-Linked-Etag = sha256
    GET  /cdn/SHA256                                       the bytes, Range requests too

Errors carry X-Error-Code as the hub's do (RepoNotFound, GatedRepo, EntryNotFound). A gated
repository lists its files to anyone and serves them to a valid token only. Faults for
tests: a file served cut after some bytes (once, or every time), a file whose bytes differ
from its advertised sha256. Every request is recorded."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

GOOD_TOKEN = "hf_test_token"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith((".gguf", ".safetensors", ".bin")) or len(data) > 10_000


@dataclass
class FakeRepo:
    name: str
    files: dict[str, bytes]
    gated: bool = False
    commit: str = ""
    advertised: dict[str, str] = field(default_factory=dict)  # path -> a wrong sha256

    def __post_init__(self) -> None:
        if not self.commit:
            self.commit = hashlib.sha1(self.name.encode()).hexdigest()

    def sha256(self, path: str) -> str:
        return self.advertised.get(path) or hashlib.sha256(self.files[path]).hexdigest()

    def sibling(self, path: str) -> dict:
        data = self.files[path]
        entry = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
        if is_lfs(path, data):
            entry["lfs"] = {"size": len(data), "sha256": self.sha256(path), "pointerSize": 134}
        return entry


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.seen: list[Seen] = []
        self.cut: dict[str, tuple[int, bool]] = {}  # path in a repo -> (bytes, every time)
        self.fail: dict[str, list[int]] = {}  # path -> statuses to answer before serving it
        self.ignore_range: set[str] = set()  # paths served whole whatever Range asks
        self._server: ThreadingHTTPServer | None = None

    def add(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.name] = repo
        return repo

    def cut_after(self, path: str, num_bytes: int, always: bool = False) -> None:
        """Serve `path` cut off after `num_bytes` of it: once, or (`always`) every time,
        a request for bytes beyond getting none."""
        self.cut[path] = (num_bytes, always)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def gets(self, path_part: str) -> list[Seen]:
        return [s for s in self.seen if s.method == "GET" and path_part in s.path]

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_CDN = re.compile(r"^/cdn/(?P<repo>[^/]+/[^/]+)/(?P<path>.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self.route(head=True)

    def do_GET(self) -> None:
        self.route(head=False)

    def answer(self, code: int, body: bytes = b"", headers: dict | None = None, head=False):
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def error(self, code: int, error_code: str, message: str, head: bool) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"X-Error-Code": error_code, "X-Error-Message": message}
        self.answer(code, body, {"Content-Type": "application/json", **headers}, head)

    def route(self, head: bool) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        hub = self.hub
        hub.seen.append(
            Seen(self.command, path, self.headers.get("Range"), self.headers.get("Authorization"))
        )
        if m := _API.match(path):
            repo = hub.repos.get(m["repo"])
            if repo is None:
                return self.error(401, "RepoNotFound", "Repository not found", head)
            info = {
                "id": repo.name,
                "modelId": repo.name,
                "sha": repo.commit,
                "gated": "auto" if repo.gated else False,
                "private": False,
                "siblings": [repo.sibling(p) for p in repo.files],
            }
            body = json.dumps(info).encode()
            return self.answer(200, body, {"Content-Type": "application/json"}, head)
        if m := _RESOLVE.match(path):
            return self.resolve(m["repo"], m["rev"], m["path"], head)
        if m := _CDN.match(path):
            repo = hub.repos.get(m["repo"])
            if repo is None or m["path"] not in repo.files:
                return self.error(404, "EntryNotFound", "no such object", head)
            return self.serve_bytes(repo, m["path"], head)
        self.error(404, "NotFound", f"no route {path}", head)

    def resolve(self, name: str, rev: str, path: str, head: bool) -> None:
        repo = self.hub.repos.get(name)
        if repo is None:
            return self.error(401, "RepoNotFound", "Repository not found", head)
        if rev not in ("main", repo.commit):
            return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        if repo.gated and self.headers.get("Authorization") != f"Bearer {GOOD_TOKEN}":
            message = f"Access to model {name} is restricted. You must have access to it."
            return self.error(401, "GatedRepo", message, head)
        if path not in repo.files:
            return self.error(404, "EntryNotFound", f"{path} does not exist", head)
        data = repo.files[path]
        common = {"X-Repo-Commit": repo.commit}
        if is_lfs(path, data):
            sha = repo.sha256(path)
            headers = {
                **common,
                "Location": f"/cdn/{name}/{path}",
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(len(data)),
                "ETag": f'"{git_blob_id(data)}"',
            }
            return self.answer(302, b"", headers, head)
        headers = {**common, "ETag": f'"{git_blob_id(data)}"'}
        return self.serve_bytes(repo, path, head, headers)

    def serve_bytes(self, repo: FakeRepo, path: str, head: bool, extra=None) -> None:
        data = repo.files[path]
        failing = self.hub.fail.get(path)
        if failing and not head:
            return self.error(failing.pop(0), "Busy", "try again later", head)
        headers = {"Accept-Ranges": "bytes", **(extra or {})}
        start, code = 0, 200
        asked = self.headers.get("Range")
        if path in self.hub.ignore_range:
            asked = None
        if asked and (m := re.match(r"bytes=(\d+)-(\d*)", asked)):
            start = int(m[1])
            end = int(m[2]) if m[2] else len(data) - 1
            if start >= len(data):
                return self.answer(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, code = data[start : end + 1], 206
        cut = self.hub.cut.get(path)
        if cut is not None and not head and (start < cut[0] or cut[1]):
            if not cut[1]:
                del self.hub.cut[path]
            self.send_response(code)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: max(cut[0] - start, 0)])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the connection dies mid-file
            return
        self.answer(code, data, headers, head)
