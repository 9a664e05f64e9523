"""A loopback stand-in for the few Hugging Face Hub endpoints ``huggingface_hub`` calls.

What it serves, as the Hub does (checked against huggingface_hub 2.4's client code):
- ``GET /api/models/{repo}[/revision/{rev}]``: model info with the resolved ``sha`` and the
  file listing (``siblings``).
- ``HEAD /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``, ``ETag`` and ``Content-Length``
  for small files; for large ("LFS") files a 302 to a blob URL on the same host with
  ``X-Linked-Etag`` / ``X-Linked-Size``, as the Hub redirects to its CDN.
- ``GET`` of either URL, honouring ``Range: bytes=N-`` with 206 and ``Content-Range``.
- ``?blobs=true`` on model info adds each file's ``size``, as the Hub does.
- Faults: a download cut after N bytes (``drop_after``) or stalled after N bytes
  (``stall_after``: the connection stays open and silent), and ``silent_server``: an
  endpoint that accepts connections and never answers.
- Errors with the Hub's ``X-Error-Code`` header: 401 ``GatedRepo`` without a token and 403
  with a token lacking access, 401 ``RepoNotFound`` for a missing repository (the Hub cannot
  tell missing from private without a token), 404 ``RevisionNotFound``, 404 ``EntryNotFound``.

What only the real Hub proves: Xet-backed downloads (``hf_xet``, used for most large files
today), cross-host CDN redirects (where the client drops the Authorization header), rate
limits (429), and the Hub's current exact headers; none of those are exercised here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class HubRepo:
    files: dict[str, bytes]
    commit: str
    branches: dict[str, str] = field(default_factory=dict)
    gated: bool = False


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str | None
    range: str | None


@dataclass
class FakeHub:
    endpoint: str = ""
    token: str = ""
    """The one token that may read gated repositories."""
    repos: dict[str, HubRepo] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    drop_after: dict[str, int] = field(default_factory=dict)
    """file name -> bytes to send of its next full GET before the connection is cut (once)."""
    stall_after: dict[str, int] = field(default_factory=dict)
    """file name -> bytes to send of its next full GET before going silent (once): the
    connection stays open and nothing more comes until the server stops."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)

    def content_gets(self) -> list[tuple[str, str | None]]:
        """(file name, Range header) for every GET of file content, in order."""
        names = {_sha256(d): n for r in self.repos.values() for n, d in r.files.items()}
        out = []
        for s in self.seen:
            if s.method != "GET" or s.path.startswith("/api/"):
                continue
            if s.path.startswith("/blobs/"):
                out.append((names.get(s.path.removeprefix("/blobs/"), s.path), s.range))
            elif "/resolve/" in s.path:
                out.append((s.path.split("/resolve/", 1)[1].split("/", 1)[1], s.range))
        return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith(".safetensors")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    # --- routing -----------------------------------------------------------------------------
    def _route(self, *, head: bool) -> None:
        hub = self.server.hub
        path = unquote(urlsplit(self.path).path)
        with hub.lock:
            hub.seen.append(Seen(self.command, path, self.headers.get("Authorization"),
                                 self.headers.get("Range")))  # fmt: skip
        if path.startswith("/api/models/"):
            rest = path.removeprefix("/api/models/")
            repo_id, _, rev = rest.partition("/revision/")
            blobs = "blobs=true" in urlsplit(self.path).query.lower()
            self._model_info(repo_id, rev or "main", blobs=blobs)
        elif path.startswith("/blobs/"):
            sha = path.removeprefix("/blobs/")
            for repo in hub.repos.values():
                for name, data in repo.files.items():
                    if _sha256(data) == sha:
                        return self._content(name, data, repo.commit, head=head)
            self._error(404, "EntryNotFound")
        elif "/resolve/" in path:
            repo_id, _, rest = path.lstrip("/").partition("/resolve/")
            rev, _, name = rest.partition("/")
            self._resolve(repo_id, rev, name, head=head)
        else:
            self._error(404, None)

    def _repo(self, repo_id: str) -> HubRepo | None:
        """The repository if this request may read it; otherwise the error is sent."""
        hub = self.server.hub
        auth = self.headers.get("Authorization")
        repo = hub.repos.get(repo_id)
        if repo is None:
            self._error(401 if auth is None else 404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and auth != f"Bearer {hub.token}":
            self._error(401 if auth is None else 403, "GatedRepo",
                        "Access to this model is restricted")  # fmt: skip
            return None
        return repo

    def _commit(self, repo: HubRepo, rev: str) -> str | None:
        if rev == repo.commit:
            return rev
        commit = repo.branches.get(rev)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _model_info(self, repo_id: str, rev: str, *, blobs: bool = False) -> None:
        repo = self._repo(repo_id)
        if repo is None or (commit := self._commit(repo, rev)) is None:
            return
        body = json.dumps({
            "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
            "gated": "manual" if repo.gated else False, "disabled": False,
            "siblings": [{"rfilename": n, **({"size": len(d)} if blobs else {})}
                         for n, d in sorted(repo.files.items())],
        }).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _resolve(self, repo_id: str, rev: str, name: str, *, head: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None or (commit := self._commit(repo, rev)) is None:
            return
        data = repo.files.get(name)
        if data is None:
            self._error(404, "EntryNotFound", "Entry not found", commit=commit)
            return
        if is_lfs(name):
            self.send_response(302)
            self.send_header("Location", f"{self.server.hub.endpoint}/blobs/{_sha256(data)}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("X-Linked-Etag", f'"{_sha256(data)}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._content(name, data, commit, head=head)

    def _content(self, name: str, data: bytes, commit: str, *, head: bool) -> None:
        hub = self.server.hub
        start, status = 0, 200
        if (rng := self.headers.get("Range")) is not None:
            start, status = int(rng.removeprefix("bytes=").split("-", 1)[0]), 206
        body = data[start:]
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{_sha256(data)}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        with hub.lock:
            cut = hub.drop_after.pop(name, None) if status == 200 else None
            stall = hub.stall_after.pop(name, None) if status == 200 else None
        if stall is not None:
            self.wfile.write(body[:stall])
            self.wfile.flush()
            hub.stopping.wait()
            self.close_connection = True
            return
        if cut is not None:
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str = "",
               commit: str | None = None) -> None:  # fmt: skip
        body = json.dumps({"error": message or "not found"}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: FakeHub


@contextlib.contextmanager
def fake_hub(token: str) -> Iterator[FakeHub]:
    """Serve a ``FakeHub`` on 127.0.0.1 (port 0) until the block ends."""
    server = _Server(("127.0.0.1", 0), _Handler)
    hub = FakeHub(endpoint=f"http://127.0.0.1:{server.server_address[1]}", token=token)
    server.hub = hub
    thread = threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class SilentServer:
    endpoint: str
    accepted: int = 0


@contextlib.contextmanager
def silent_server() -> Iterator[SilentServer]:
    """An endpoint on 127.0.0.1 that accepts every connection and never sends a byte: what
    a hung proxy or a wedged server looks like to a client. Counts accepted connections."""
    listener = socket.create_server(("127.0.0.1", 0))
    server = SilentServer(endpoint=f"http://127.0.0.1:{listener.getsockname()[1]}")
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)
            server.accepted += 1

    thread = threading.Thread(target=accept, name="silent-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
