"""An Azure Blob prefix as the artifact location: block blobs, the manifest as commit.

Azure has no rename, so, as on S3, blobs are written under the artifact prefix itself and the
manifest blob ``modelstage.json`` is written last: without it nothing there counts as an
artifact (``existing()`` and every reader look for the manifest first).

**Blocks.** A file larger than one block is uploaded as blocks (``Put Block``), each sent
from a buffer that the rank writer filled and hashed (the chunk hashes are computed from that
copy, so the source is read once), and made a blob by ``Put Block List``. Uncommitted blocks
are invisible: a blob appears only whole, at the commit of its block list, and a killed run
leaves no partial blob (Azure drops uncommitted blocks after a week, or when the blob is next
committed). A file of one block goes up in one ``Put Blob``.

**A content hash per blob.** ``Put Block List`` and ``Put Blob`` set the blob's metadata, and
the hash is known by then: every blob carries ``blake3`` (the root of its chunk hashes; the
chunk hashes go into the manifest), ``blake3_chunk_bytes`` and ``modelstage_run``, the run
key (metadata names are identifiers on Azure: underscores, not dashes).

**Reruns.** The same rule as on S3 (``destinations/s3.py``): one listing (with metadata); a
blob of this run key and size is read back in parallel ranged reads and reused when it hashes
to its recorded root; a blob without a run key is foreign and never overwritten.

**Retries and memory.** The SDK retries each request (exponential backoff; connect and read
timeouts from ``AzureOptions``), and each block upload has an outer retry loop
(``azure_client.with_retries``). Memory is one block buffer per open blob plus
``concurrency`` blocks in flight, whatever the checkpoint's size.
"""

from __future__ import annotations

import base64
import io
import re
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from modelstage.core.azure_client import AzureClient, AzureLocation, AzureOptions, with_retries
from modelstage.core.errors import ArtifactError, DestinationError, SpecError
from modelstage.core.integrity import (
    ChunkedHasher,
    FileDigest,
    FileToHash,
    digest_bytes,
    hash_files,
)
from modelstage.core.location import AzureArtifact
from modelstage.core.manifest import MANIFEST, Manifest

from ..pieces import Piece, copy_piece, piece_nbytes
from .base import Destination

MiB = 1024 * 1024
MIN_BLOCK_BYTES = 1 * MiB
MAX_BLOCKS = 50_000
"""Azure's most committed blocks per blob."""
BLOCK_BUFFER_BUDGET = 256 * MiB
"""Block buffers of one run: one filling per open blob plus ``concurrency`` in flight."""
HASH_KEY, CHUNK_KEY, RUN_KEY = "blake3", "blake3_chunk_bytes", "modelstage_run"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
CONTENT_TYPE = "application/octet-stream"


def block_id(number: int) -> str:
    """Block ids of one blob must have one length: a fixed-width counter, base64-encoded."""
    return base64.b64encode(f"modelstage-{number:06d}".encode()).decode()


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview: the SDK rewinds it when it retries."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self.view) - self.pos)
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos


class AzureBlobSink:
    """One blob written front to back: one ``Put Blob`` if it fits a block, else blocks."""

    def __init__(self, dest: AzureDestination, name: str, size: int) -> None:
        self.dest, self.name, self.size = dest, name, size
        self.key = dest.location.key(name)
        per_block = -(-size // MAX_BLOCKS)
        self.block_bytes = max(dest.block_bytes, -(-per_block // MiB) * MiB)
        self.blocks_mode = size > self.block_bytes
        self.hash = ChunkedHasher(dest.chunk_bytes)
        self.written = self.fill = 0
        self.buf: bytearray | None = None
        self.blocks: list[Future[str]] = []
        self.failed: BaseException | None = None

    def write(self, data: Piece) -> None:
        if self.failed is not None:
            raise self.failed
        total = piece_nbytes(data)
        if self.written + total > self.size:
            raise AssertionError(f"{self.key}: more than the announced {self.size} bytes")
        done = 0
        while done < total:
            if self.buf is None:
                self.buf = self.dest.take_buffer(min(self.block_bytes, self.size))
                self.fill = 0
            space = np.frombuffer(self.buf, dtype=np.uint8)[self.fill :]
            n = copy_piece(data, done, space)
            self.hash.update(space[:n].data)  # hashed from our copy, still in cache
            self.fill, done = self.fill + n, done + n
            if self.fill == len(self.buf) and self.blocks_mode:
                self._flush_block()
        self.written += total

    def _flush_block(self) -> None:
        assert self.buf is not None
        number, buf, fill = len(self.blocks), self.buf, self.fill
        self.buf = None
        self.dest.inflight.acquire()  # backpressure: at most `concurrency` blocks in flight
        try:
            self.blocks.append(self.dest.pool.submit(self._stage, number, buf, fill))
        except BaseException:
            self.dest.inflight.release()
            raise

    def _stage(self, number: int, buf: bytearray, fill: int) -> str:
        ident = block_id(number)
        try:
            if self.failed is not None:
                raise self.failed
            body = memoryview(buf)[:fill]
            blob = self.dest.az.blob(self.key)
            with_retries(
                lambda: blob.stage_block(ident, _ViewReader(body), length=fill), attempts=3
            )
            return ident
        except BaseException as e:
            self.failed = self.failed or self.dest.az.error(e, self.dest.uri_of(self.name))
            raise self.failed from None
        finally:
            self.dest.give_back(buf)
            self.dest.inflight.release()

    def close(self) -> FileDigest:
        from azure.storage.blob import BlobBlock, ContentSettings

        if self.written != self.size:
            raise AssertionError(f"{self.key}: wrote {self.written} of {self.size} bytes")
        digest = self.hash.finish()
        meta = {
            HASH_KEY: digest.root,
            CHUNK_KEY: str(digest.chunk_bytes),
            RUN_KEY: self.dest.run_key,
        }
        settings = ContentSettings(content_type=CONTENT_TYPE)
        blob = self.dest.az.blob(self.key)
        if not self.blocks_mode:
            body = memoryview(self.buf or b"")[: self.fill]
            self.dest.call(
                lambda: blob.upload_blob(
                    _ViewReader(body), length=self.fill, overwrite=True, metadata=meta,
                    content_settings=settings, max_concurrency=1,
                ),
                self.key,
            )  # fmt: skip
            if self.buf is not None:
                self.dest.give_back(self.buf)
                self.buf = None
            return digest
        if self.fill:
            self._flush_block()
        ids = [BlobBlock(block_id=f.result()) for f in self.blocks]
        self.dest.call(
            lambda: blob.commit_block_list(ids, metadata=meta, content_settings=settings),
            self.key,
        )
        return digest

    def abort(self) -> None:
        """Stop: wait for blocks in flight. Uncommitted blocks are invisible and dropped by
        Azure; nothing is committed."""
        self.failed = self.failed or DestinationError(f"{self.key}: aborted")
        for f in self.blocks:
            f.cancel()
        for f in self.blocks:
            if not f.cancelled():
                f.exception()
        if self.buf is not None:
            self.dest.give_back(self.buf)
            self.buf = None


class AzureDestination(Destination):
    def __init__(
        self, uri: str, options: AzureOptions | None = None, *, open_files: int = 1
    ) -> None:
        """``open_files``: blobs written at once (one per rank for per-rank formats); each
        holds a block buffer while it fills, so many of them get smaller blocks."""
        options = options or AzureOptions.from_env()
        block_bytes, concurrency = options.block_bytes, max(1, options.concurrency)
        if block_bytes < MIN_BLOCK_BYTES:
            raise SpecError(f"Azure block size must be at least {MIN_BLOCK_BYTES} bytes (1 MiB)")
        fit = BLOCK_BUFFER_BUDGET // (open_files + concurrency) // MiB * MiB
        self.block_bytes = max(MIN_BLOCK_BYTES, min(block_bytes, fit))
        self.location = AzureLocation.parse(uri)
        if not self.location.prefix:
            raise ArtifactError(f"{uri}: an artifact needs a prefix (az://CONTAINER/PREFIX/)")
        self.uri = self.location.uri
        self.az = AzureClient(options, self.location.container)
        self.artifact = AzureArtifact(self.location, self.az, workers=concurrency)
        self.concurrency = concurrency
        self.run_key = ""
        self.inflight = threading.BoundedSemaphore(concurrency)
        self._free: list[bytearray] = []
        self._free_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._present: dict[str, tuple[int, str, dict[str, str]]] = {}
        self.reused: list[str] = []
        """Names of blobs this run found complete and did not upload again."""

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, "az-block")
        return self._pool

    def take_buffer(self, size: int) -> bytearray:
        with self._free_lock:
            for i, buf in enumerate(self._free):
                if len(buf) == size:
                    return self._free.pop(i)
        return bytearray(size)

    def give_back(self, buf: bytearray) -> None:
        with self._free_lock:
            if len(self._free) < self.concurrency:
                self._free.append(buf)

    def uri_of(self, name: str) -> str:
        return self.artifact.where(name)

    def call(self, fn: Any, key: str) -> Any:
        return self.artifact.call(fn, key)

    # -- the Destination interface --------------------------------------------------------

    def existing(self) -> Manifest | None:
        """The committed manifest, if any; blobs without one are a run to resume."""
        return self.artifact.read_manifest()

    def begin(self, run_key: str = "") -> None:
        self.run_key = run_key
        self._present = self.artifact.blobs()

    def begin_shared(
        self, run_key: str, *, finalize: bool = False, params: Mapping[str, Any] | None = None
    ) -> None:
        """Workers write their blobs under the prefix itself, like one stager does."""
        self.begin(run_key)

    def check_part(self, name: str, size: int) -> FileDigest:
        found = self.completed(name, size)
        if found is None:
            state = "has the wrong size or run" if name in self._present else "is missing"
            raise ArtifactError(
                f"{self.uri_of(name)} {state} (expected {size} bytes from this run: workers and "
                "finalize must run the same stager with the same arguments); rerun the worker "
                "that owns it (`modelstage stage --group i/n`), then finalize again"
            )
        return found

    def release(self) -> None:
        self._shutdown()

    def completed(self, name: str, size: int) -> FileDigest | None:
        """The digest of a blob an earlier run of this run key finished, else None: the blob
        is read back and must hash to the root its metadata records."""
        self._refuse_foreign(name)
        found = self._present.get(name)
        if found is None or found[0] != size:
            return None
        _, etag, meta = found
        root, chunk = meta.get(HASH_KEY, ""), meta.get(CHUNK_KEY, "")
        if meta.get(RUN_KEY) != self.run_key or not _HEX64.match(root) or not chunk.isdigit():
            return None
        if int(chunk) < 1:
            return None
        read_into = self.artifact.read_into(name, etag)
        job = FileToHash(self.uri_of(name), size, read_into, chunk_bytes=int(chunk))
        digest = hash_files([job], workers=self.concurrency)[0][0]
        if digest.root != root:
            print(
                f"az: {self.uri_of(name)} does not hash to its recorded content hash; "
                "writing it again",
                file=sys.stderr,
            )
            return None
        self.reused.append(name)
        return digest

    def _refuse_foreign(self, name: str) -> None:
        found = self._present.get(name)
        if found is not None and RUN_KEY not in found[2]:
            raise ArtifactError(
                f"{self.uri_of(name)} exists and was not written by modelstage; it is never "
                "overwritten: remove it or choose another --out"
            )

    def open_sink(self, name: str, size: int) -> AzureBlobSink:
        return AzureBlobSink(self, name, size)

    def write_small(self, name: str, data: bytes) -> FileDigest:
        digest = digest_bytes(data, self.chunk_bytes)
        self._refuse_foreign(name)
        found = self._present.get(name)
        if found is not None and found[0] == len(data):
            meta = found[2]
            if meta.get(HASH_KEY) == digest.root and meta.get(CHUNK_KEY) == str(self.chunk_bytes):
                self.reused.append(name)
                return digest
        return super().write_small(name, data)

    def commit(self, manifest: Manifest) -> None:
        from azure.storage.blob import ContentSettings

        present = self.artifact.blobs()
        missing = sorted(n for n in manifest.files if n not in present)
        stray = sorted(n for n in present if n not in manifest.files and n != MANIFEST)
        if missing:
            raise DestinationError(f"{self.uri}: blobs vanished while staging: {missing[:5]}")
        if stray:
            raise ArtifactError(
                f"{self.uri} holds blobs that are not part of this artifact "
                f"({', '.join(stray[:5])}); remove them or choose another --out"
            )
        data = manifest.to_json().encode()
        root = digest_bytes(data, self.chunk_bytes).root
        meta = {HASH_KEY: root, CHUNK_KEY: str(self.chunk_bytes), RUN_KEY: self.run_key}
        blob = self.az.blob(self.location.key(MANIFEST))
        self.call(
            lambda: blob.upload_blob(
                data, overwrite=True, metadata=meta,
                content_settings=ContentSettings(content_type="application/json"),
            ),
            self.location.key(MANIFEST),
        )  # fmt: skip
        self._shutdown()
        if self.reused:
            print(
                f"az: reused {len(self.reused)} complete blob(s) of an earlier run", file=sys.stderr
            )

    def abort(self) -> None:
        """Stop writing. Committed blobs stay: invisible without the manifest, a rerun of the
        same run key reuses them instead of uploading them again."""
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._free.clear()
