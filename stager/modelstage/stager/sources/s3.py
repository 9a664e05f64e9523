"""A Hugging Face checkpoint under an S3 prefix (``s3://bucket/prefix``), read with ranged GETs.

The stager asks for headers first, then exactly the byte ranges of the shard plan; this
source turns each ``read_range`` into ranged GETs of those bytes only. A large range (the
rank writer reads up to 32 MiB at a time) is split into pieces of ``range_bytes`` fetched
concurrently, each streamed from the socket straight into its slice of the caller's buffer
(``s3_client.get_range_into``, shared with the loader plugin's S3 reader), so memory stays at
the caller's buffers.

Every GET carries ``If-Match`` with the ETag seen when listing: the ETags are the source
identity recorded in the manifest, so an object replaced while staging fails the run
instead of producing rank files that match no recorded identity.

The client (endpoint, region, path-style addressing, CA bundle, credentials, checksum
settings, botocore retries) is the one ``s3_client.S3Client`` builds for the S3 destination,
so ``--s3-*`` options mean the same for sources and destinations.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from modelstage.core.errors import CheckpointError
from modelstage.core.s3_client import (
    S3Client,
    S3Location,
    S3Options,
    get_range_into,
    precondition_failed,
)

from .base import Source, safe_name

MiB = 1024 * 1024
RANGE_BYTES = 8 * MiB
"""Size of one ranged GET: big enough to amortise a request, small enough to spread a
32 MiB read over several connections."""


@dataclass(frozen=True)
class _Object:
    size: int
    etag: str


class S3Source(Source):
    def __init__(
        self, uri: str, options: S3Options | None = None, *, range_bytes: int = RANGE_BYTES
    ) -> None:
        self.location = S3Location.parse(uri)
        self.options = options or S3Options()
        self.concurrency = max(1, self.options.concurrency)
        self.range_bytes = range_bytes
        self.s3 = S3Client(self.options, concurrency=self.concurrency)
        self.uri = self.location.uri
        self._objects = self._list()
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-get")

    @classmethod
    def from_uri(cls, uri: str, *, s3: S3Options | None = None, **_: Any) -> S3Source:
        return cls(uri, s3)

    def _error(self, e: BaseException, what: str) -> CheckpointError:
        """The S3 client's one-line, credential-free description, as a source error."""
        return CheckpointError(str(self.s3.error(e, what)))

    def _list(self) -> dict[str, _Object]:
        """Objects directly under the prefix (a checkpoint's files are at its top level)."""
        prefix = f"{self.location.prefix}/" if self.location.prefix else ""
        found: dict[str, _Object] = {}
        try:
            pages = self.s3.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix) :]
                    if name:  # "prefix/" itself: a folder marker some tools create
                        found[name] = _Object(int(obj["Size"]), str(obj["ETag"]).strip('"'))
        except Exception as e:
            raise self._error(e, self.uri) from None
        if not found:
            raise CheckpointError(
                f"{self.uri}: no objects under this prefix; expected a Hugging Face checkpoint "
                "(config.json and *.safetensors) there"
            )
        return found

    def _object(self, name: str) -> _Object:
        obj = self._objects.get(safe_name(name, self.uri))
        if obj is None:
            raise CheckpointError(f"{self.uri}{name}: no such object")
        return obj

    def list_files(self) -> list[str]:
        return sorted(self._objects)

    def size(self, name: str) -> int:
        return self._object(name).size

    def read_range(self, name: str, offset: int, out: memoryview) -> None:
        obj = self._object(name)
        if offset < 0 or offset + len(out) > obj.size:
            raise CheckpointError(
                f"{self.uri}{name}: object ends at byte {obj.size}, but bytes up to "
                f"{offset + len(out)} are needed; it is truncated"
            )
        pieces = [
            (start, min(start + self.range_bytes, len(out)))
            for start in range(0, len(out), self.range_bytes)
        ]
        if len(pieces) <= 1:
            if pieces:
                self._get(name, obj, offset, out)
            return
        futures: list[Future[None]] = [
            self._pool.submit(self._get, name, obj, offset + a, out[a:b]) for a, b in pieces
        ]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        wait(pending)  # no GET may still write into ``out`` once this returns or raises
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def _get(self, name: str, obj: _Object, offset: int, out: memoryview) -> None:
        """One ranged GET into ``out``; transient failures (also mid-body) are retried whole."""
        try:
            get_range_into(
                self.s3, self.location.bucket, self.location.key(name), obj.etag, offset, [out]
            )
        except Exception as e:
            if precondition_failed(e):
                raise CheckpointError(
                    f"{self.uri}{name}: the object changed while staging (its ETag is no "
                    f"longer {obj.etag}); stage again to pick up the new content"
                ) from None
            raise self._error(e, f"{self.uri}{name}") from None

    def identity(self, files: list[str]) -> dict[str, Any]:
        """ETag and size per object: S3 changes the ETag whenever an object's content is
        replaced, so together they pin what was read (DESIGN section 3). No ``uri`` key: the
        manifest's ``source.uri`` is the requested URI, the one the digest was computed from."""
        return {
            "kind": "s3",
            "location": self.uri,
            "files": [
                {"name": n, "size": self._object(n).size, "etag": self._object(n).etag}
                for n in files
            ],
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
