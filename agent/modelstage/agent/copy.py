"""``modelstage node-copy``: a copy Job's side of the copy protocol (``server.py``).

The Job runs in the tenant's namespace with no hostPath: it reads the artifact through what
the tenant already grants (its claim, read-only, or S3 with its credentials) and streams the
manifest and every file the agent on its node asks for, a few files at once, authenticated by
its projected ServiceAccount token. The agent verifies every chunk before anything is kept, so
this side checks nothing the agent would not; a refusal is the agent's message, as it is
(``error: <message>`` on the CLI's last line, which the operator shows per node).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from modelstage.core import node_cache
from modelstage.core.errors import ArtifactError, ModelstageError
from modelstage.core.location import ArtifactLocation, Listed, check_files, open_artifact
from modelstage.core.manifest import MANIFEST, Manifest, check_ranks_present

if TYPE_CHECKING:
    from modelstage.core.s3_client import S3Options

PARALLEL_FILES = 4
"""Files streamed at once (S3: each file's reads overlap the others')."""
SEND_BLOCK = 4 * 1024 * 1024
TIMEOUT = 300.0
"""Seconds a request may wait for the agent (a large file's last chunk, the commit's fsync)."""


class NodeCopyError(ModelstageError):
    """The agent refused (its message) or could not be reached."""


@dataclass
class AgentClient:
    """The agent's copy endpoint, one connection per thread."""

    url: str
    token_file: Path
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise NodeCopyError(f"--agent {self.url!r}: expected http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port or node_cache.DEFAULT_COPY_PORT

    def _token(self) -> str:
        try:
            return self.token_file.read_text().strip()
        except OSError as e:
            raise NodeCopyError(f"--token-file {self.token_file}: {e.strerror or e}") from None

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)
            self._local.conn = conn
        return conn

    def request(
        self, method: str, path: str, length: int, body: Iterator[bytes | memoryview]
    ) -> dict[str, Any]:
        """Send ``length`` bytes from ``body``; the agent's JSON answer, or ``NodeCopyError``
        with its message."""
        conn = self._connection()
        try:
            conn.putrequest(method, path)
            conn.putheader("Authorization", f"Bearer {self._token()}")
            conn.putheader("Content-Type", "application/octet-stream")
            conn.putheader("Content-Length", str(length))
            conn.endheaders()
            sent = _send(conn, body)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            self._local.conn = None
            raise NodeCopyError(f"the node agent at {self.url}: {e}") from None
        if response.will_close:
            conn.close()
            self._local.conn = None
        return _answer(response.status, data, sent)


def _send(conn: http.client.HTTPConnection, body: Iterator[bytes | memoryview]) -> OSError | None:
    """The body sent; the agent may answer (and close) before the end: then the error it
    caused, and the agent's answer is read all the same."""
    try:
        for block in body:
            conn.send(block)
    except OSError as e:
        return e
    return None


def _answer(status: int, data: bytes, sent: OSError | None) -> dict[str, Any]:
    try:
        answer = json.loads(data or b"{}")
    except ValueError:
        answer = {"error": f"HTTP {status}: {data[:200]!r}"}
    if not isinstance(answer, dict):
        answer = {"error": f"HTTP {status}: not a JSON object"}
    if status != 200:
        raise NodeCopyError(str(answer.get("error") or f"HTTP {status}"))
    if sent is not None:
        raise NodeCopyError(f"the agent answered before the whole body was sent: {sent}")
    return answer


def _file_blocks(
    source: ArtifactLocation, name: str, listed: Listed, size: int
) -> Iterator[memoryview]:
    """The file's bytes, ``SEND_BLOCK`` at a time, in one reused buffer."""
    buf = memoryview(bytearray(min(SEND_BLOCK, max(size, 1))))
    with source.reader(name, listed) as read_into:
        offset = 0
        while offset < size:
            view = buf[: min(len(buf), size - offset)]
            read_into(offset, view)
            yield view
            offset += len(view)


def read_artifact(
    artifact: str, digest: str, tp: int | None, s3: S3Options | None
) -> tuple[ArtifactLocation, bytes, Manifest, dict[str, Listed]]:
    """The artifact, its manifest bytes as stored, parsed and checked, and its listing."""
    node_cache.check_digest(digest)
    source = open_artifact(artifact, s3)
    try:
        raw = source.manifest_bytes()
    except OSError as e:
        raise ArtifactError(f"{source.where(MANIFEST)}: cannot read: {e.strerror}") from None
    if raw is None:
        raise ArtifactError(f"{source.uri}: no {MANIFEST}; the artifact is incomplete")
    manifest = Manifest.from_json(raw, source.where(MANIFEST))
    manifest.check_expected(source.uri, digest=digest, tp=tp)
    check_ranks_present(source.uri, manifest)
    listing = source.listing()
    check_files(source, manifest, sorted(manifest.files), listing)
    return source, raw, manifest, listing


def node_copy(
    artifact: str,
    *,
    digest: str,
    agent: str,
    token_file: Path,
    tp: int | None = None,
    s3: S3Options | None = None,
) -> dict[str, Any]:
    """Offer the artifact to the agent at ``agent``, stream what it needs, commit; the
    one-line summary."""
    started = time.monotonic()
    source, raw, manifest, listing = read_artifact(artifact, digest, tp, s3)
    client = AgentClient(agent, token_file)
    offer = client.request("POST", f"/v1/offers?digest={digest}", len(raw), iter([raw]))
    content = str(offer.get("content", ""))
    node_cache.check_content(content)
    need = [str(n) for n in offer.get("need") or []]
    unknown = sorted(set(need) - set(manifest.files))
    if unknown:
        raise NodeCopyError(f"the agent asked for files not in the manifest: {unknown[:3]}")

    def put(name: str) -> None:
        size = manifest.files[name].size
        path = f"/v1/copies/{content}/files/{quote(name, safe='')}"
        client.request("PUT", path, size, _file_blocks(source, name, listing[name], size))

    _each(put, need)
    done = client.request("POST", f"/v1/copies/{content}/commit?digest={digest}", 0, iter([]))
    seconds = time.monotonic() - started
    sent = sum(manifest.files[n].size for n in need)
    return {
        "content": content,
        "digest": digest,
        "bytes": done.get("bytes", manifest.bytes),
        "files": len(manifest.files),
        "seconds": round(seconds, 3),
        "bytesPerSecond": round(sent / seconds, 1) if seconds > 0 else 0.0,
        "alreadyComplete": bool(done.get("alreadyComplete")),
        "node": offer.get("node"),
    }


def _each(run: Callable[[str], None], names: list[str]) -> None:
    """``run`` for each name, ``PARALLEL_FILES`` at once; the first failure raised once the
    others in flight ended."""
    if not names:
        return
    with ThreadPoolExecutor(PARALLEL_FILES, thread_name_prefix="modelstage-send") as pool:
        futures = [pool.submit(run, n) for n in names]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()


def copy_local(artifact: str, *, digest: str, root: Path) -> dict[str, Any]:
    """The same copy into a root this process owns, through the agent's receiving code
    without HTTP (the bench's copy row; what the agent does for a Job, minus the network)."""
    from .receive import Receiver

    root.mkdir(parents=True, exist_ok=True)
    source, raw, manifest, listing = read_artifact(artifact, digest, None, None)
    receiver = Receiver(root, "local", budget=1 << 62)
    offer = receiver.offer("local", digest, raw)

    def put(name: str) -> None:
        size = manifest.files[name].size
        blocks = _file_blocks(source, name, listing[name], size)
        pending = bytearray()

        def read(n: int) -> bytes:
            while len(pending) < n:
                block = next(blocks, None)
                if block is None:
                    break
                pending.extend(block)
            data = bytes(pending[:n])
            del pending[:n]
            return data

        receiver.put_file("local", offer["content"], name, size, read)

    _each(put, offer["need"])
    done: dict[str, Any] = receiver.commit("local", offer["content"], digest)
    return done

