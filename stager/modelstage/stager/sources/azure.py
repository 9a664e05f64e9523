"""A Hugging Face checkpoint under an Azure Blob prefix (``az://container/prefix``).

The same shape as ``sources/s3.py``: one listing (names, sizes, ETags), then exactly the byte
ranges of the shard plan, a large range split into pieces of ``range_bytes`` read concurrently
straight into slices of the caller's buffer, so memory stays at the caller's buffers. Every
read is conditional on the ETag listed (``If-Match``): the ETags are the source identity
recorded in the manifest, so a blob replaced while staging fails the run.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from modelstage.core.azure_client import (
    AzureClient,
    AzureLocation,
    AzureOptions,
    get_range_into,
    precondition_failed,
)
from modelstage.core.errors import CheckpointError

from .base import Source, safe_name

MiB = 1024 * 1024
RANGE_BYTES = 8 * MiB


class AzureSource(Source):
    def __init__(
        self, uri: str, options: AzureOptions | None = None, *, range_bytes: int = RANGE_BYTES
    ) -> None:
        self.location = AzureLocation.parse(uri)
        self.options = options or AzureOptions.from_env()
        self.concurrency = max(1, self.options.concurrency)
        self.range_bytes = range_bytes
        self.az = AzureClient(self.options, self.location.container)
        self.uri = self.location.uri
        self._blobs = self._list()
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="az-get")

    @classmethod
    def from_uri(cls, uri: str, *, azure: AzureOptions | None = None, **_: Any) -> AzureSource:
        return cls(uri, azure)

    def _error(self, e: BaseException, what: str) -> CheckpointError:
        return CheckpointError(str(self.az.error(e, what)))

    def _list(self) -> dict[str, tuple[int, str]]:
        """Blobs directly under the prefix (a checkpoint's files are at its top level)."""
        prefix = self.location.key("")
        found: dict[str, tuple[int, str]] = {}
        try:
            for blob in self.az.client.walk_blobs(name_starts_with=prefix, delimiter="/"):
                name = str(blob.name)[len(prefix) :]
                if name and not name.endswith("/"):  # virtual folders are BlobPrefix items
                    found[name] = (int(blob.size), str(blob.etag).strip('"'))
        except Exception as e:
            raise self._error(e, self.uri) from None
        if not found:
            raise CheckpointError(
                f"{self.uri}: no blobs under this prefix; expected a Hugging Face checkpoint "
                "(config.json and *.safetensors) there"
            )
        return found

    def _blob(self, name: str) -> tuple[int, str]:
        blob = self._blobs.get(safe_name(name, self.uri))
        if blob is None:
            raise CheckpointError(f"{self.uri}{name}: no such blob")
        return blob

    def list_files(self) -> list[str]:
        return sorted(self._blobs)

    def size(self, name: str) -> int:
        return self._blob(name)[0]

    def read_range(self, name: str, offset: int, out: memoryview) -> None:
        size, etag = self._blob(name)
        if offset < 0 or offset + len(out) > size:
            raise CheckpointError(
                f"{self.uri}{name}: blob ends at byte {size}, but bytes up to "
                f"{offset + len(out)} are needed; it is truncated"
            )
        pieces = [
            (start, min(start + self.range_bytes, len(out)))
            for start in range(0, len(out), self.range_bytes)
        ]
        if len(pieces) <= 1:
            if pieces:
                self._get(name, etag, offset, out)
            return
        futures: list[Future[None]] = [
            self._pool.submit(self._get, name, etag, offset + a, out[a:b]) for a, b in pieces
        ]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        wait(pending)  # no read may still write into ``out`` once this returns or raises
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def _get(self, name: str, etag: str, offset: int, out: memoryview) -> None:
        try:
            get_range_into(self.az, self.location.key(name), etag, offset, out)
        except Exception as e:
            if precondition_failed(e):
                raise CheckpointError(
                    f"{self.uri}{name}: the blob changed while staging (its ETag is no "
                    f"longer {etag}); stage again to pick up the new content"
                ) from None
            raise self._error(e, f"{self.uri}{name}") from None

    def identity(self, files: list[str]) -> dict[str, Any]:
        """ETag and size per blob: Azure gives a blob a new ETag whenever it is written, so
        together they pin what was read (DESIGN section 3)."""
        return {
            "kind": "az",
            "location": self.uri,
            "files": [
                {"name": n, "size": self._blob(n)[0], "etag": self._blob(n)[1]} for n in files
            ],
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
