"""An S3 prefix as the artifact location: parallel multipart uploads, the manifest as commit.

S3 has no rename, so objects are written under the artifact prefix itself and the manifest
object ``modelstage.json`` is written last: without it nothing there counts as an artifact
(``existing()`` and every reader look for the manifest first).

**A content hash per object.** Every object carries ``x-amz-meta-blake3``, the root of its
chunk hashes (``integrity.py``; the chunk hashes themselves go into the manifest: S3 metadata
holds 2 KB). A rank file's hash is known only once its last byte has streamed through, but a
multipart upload fixes its metadata at ``CreateMultipartUpload``. Objects that fit one part
are buffered anyway, so they are hashed first and sent with one ``PutObject`` holding the
hash. Larger objects are hashed while streaming and, once complete, get the hash by a
server-side ``CopyObject`` onto themselves with ``MetadataDirective=REPLACE`` (guarded by
``CopySourceIfMatch`` on the ETag just returned, and done as a multipart ``UploadPartCopy``
above 5 GiB). That costs one request and server-side copying, never a second pass over the
source or the network.
Rejected alternatives: hashing every object before uploading it (reads the source twice)
and keeping hashes only in the manifest (a rerun could not tell a finished object from a
foreign one, and the issue asks for the metadata).

**Reruns.** Each object also carries ``x-amz-meta-modelstage-run``, the *run key*: a hash
of the artifact digest, the resolved source identity, the layout and the stager version,
known before any byte is written. The stager is deterministic, so two runs with the same
key write identical bytes. A rerun lists the prefix once and, for each object it is about
to write, reuses it when the run key and the size match and a content hash is stored, and
its bytes, read back in parallel ranged GETs, hash to it (the chunk hashes the manifest needs
are recomputed on the way: the completion check is the same chunked verification as
``verify``). Small files (``config.json``, tokenizer files) are compared on their hash
directly. Objects without a run key are foreign and never overwritten. Stale
multipart uploads of a killed run are aborted at ``begin``; one stager per location (the
operator's Job names are deterministic).

**Retries.** botocore's ``standard`` mode retries each request with exponential backoff
and jitter on throttling, 5xx and connection errors; part uploads get an outer retry loop
(``with_retries``) so that one part outlasting botocore's attempts does not lose the
upload. Memory is bounded: one part buffer per open object plus ``concurrency`` parts in
flight, whatever the checkpoint's size.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from modelstage.core.errors import ArtifactError, DestinationError, SpecError
from modelstage.core.integrity import (
    ChunkedHasher,
    FileDigest,
    FileToHash,
    digest_bytes,
    hash_files,
)
from modelstage.core.location import S3Artifact
from modelstage.core.manifest import (
    MANIFEST,
    Manifest,
)
from modelstage.core.s3_client import S3Client, S3Location, S3Options, with_retries

from ..pieces import Piece, copy_piece, piece_nbytes
from .base import Destination

MiB = 1024 * 1024
MIN_PART_BYTES = 5 * MiB
"""S3's smallest part (all but the last)."""
MAX_PARTS = 10_000
PART_BUFFER_BUDGET = 256 * MiB
"""Part buffers of one run: one filling per open object plus ``concurrency`` in flight
(16 MiB parts up to TP=8 with 8 in flight; smaller, down to S3's 5 MiB, beyond)."""
COPY_LIMIT = 5 * 1024 * MiB
"""The largest object one ``CopyObject`` may copy; larger ones are copied part by part."""
HASH_KEY, CHUNK_KEY, RUN_KEY = "blake3", "blake3-chunk-bytes", "modelstage-run"
"""Metadata: the content hash (root of the chunk hashes), its chunk size, the run key."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
CONTENT_TYPE = "application/octet-stream"


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview: botocore rewinds it on retries."""

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


class S3ObjectSink:
    """One object written front to back: a single PUT if it fits one part, else multipart."""

    def __init__(self, dest: S3Destination, name: str, size: int) -> None:
        self.dest, self.name, self.size = dest, name, size
        self.key = dest.location.key(name)
        per_part = -(-size // MAX_PARTS)  # S3 allows 10,000 parts: larger objects, larger parts
        self.part_bytes = max(dest.part_bytes, -(-per_part // MiB) * MiB)
        self.multipart = size > self.part_bytes
        self.hash = ChunkedHasher(dest.chunk_bytes)
        self.written = self.fill = 0
        self.buf: bytearray | None = None
        self.upload_id: str | None = None
        self.parts: list[Future[dict[str, Any]]] = []
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
                self.buf = self.dest.take_buffer(min(self.part_bytes, self.size))
                self.fill = 0
            space = np.frombuffer(self.buf, dtype=np.uint8)[self.fill :]
            n = copy_piece(data, done, space)
            self.hash.update(space[:n].data)  # hashed from our copy, still in cache
            self.fill, done = self.fill + n, done + n
            if self.fill == len(self.buf) and self.multipart:
                self._flush_part()
        self.written += total

    def _flush_part(self) -> None:
        assert self.buf is not None
        client = self.dest.s3.client
        if self.upload_id is None:
            created = self.dest.call(
                lambda: client.create_multipart_upload(
                    Bucket=self.dest.location.bucket,
                    Key=self.key,
                    ContentType=CONTENT_TYPE,
                    Metadata={RUN_KEY: self.dest.run_key},
                ),
                self.key,
            )
            self.upload_id = created["UploadId"]
        number, buf, fill = len(self.parts) + 1, self.buf, self.fill
        self.buf = None
        self.dest.inflight.acquire()  # backpressure: at most `concurrency` parts in flight
        try:
            self.parts.append(self.dest.pool.submit(self._upload_part, number, buf, fill))
        except BaseException:
            self.dest.inflight.release()
            raise

    def _upload_part(self, number: int, buf: bytearray, fill: int) -> dict[str, Any]:
        client = self.dest.s3.client
        try:
            if self.failed is not None:
                raise self.failed
            body = memoryview(buf)[:fill]
            response = with_retries(
                lambda: client.upload_part(
                    Bucket=self.dest.location.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    PartNumber=number,
                    Body=_ViewReader(body),
                    ContentLength=fill,
                )
            )
            return {"PartNumber": number, "ETag": response["ETag"]}
        except BaseException as e:
            self.failed = self.failed or self.dest.s3.error(e, self.dest.uri_of(self.name))
            raise self.failed from None
        finally:
            self.dest.give_back(buf)
            self.dest.inflight.release()

    def close(self) -> FileDigest:
        if self.written != self.size:
            raise AssertionError(f"{self.key}: wrote {self.written} of {self.size} bytes")
        digest = self.hash.finish()
        meta = {HASH_KEY: digest.root, CHUNK_KEY: str(digest.chunk_bytes)}
        client, bucket = self.dest.s3.client, self.dest.location.bucket
        if not self.multipart:
            body = memoryview(self.buf or b"")[: self.fill]
            self.dest.call(
                lambda: client.put_object(
                    Bucket=bucket,
                    Key=self.key,
                    Body=_ViewReader(body),
                    ContentLength=self.fill,
                    ContentType=CONTENT_TYPE,
                    Metadata={**meta, RUN_KEY: self.dest.run_key},
                ),
                self.key,
            )
            if self.buf is not None:
                self.dest.give_back(self.buf)
                self.buf = None
            return digest
        if self.fill:
            self._flush_part()
        parts = [f.result() for f in self.parts]
        done = self.dest.call(
            lambda: client.complete_multipart_upload(
                Bucket=bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            ),
            self.key,
        )
        self.upload_id = None
        self.dest.set_metadata(self.key, self.size, done["ETag"], meta)
        return digest

    def abort(self) -> None:
        """Stop: wait for parts in flight and abort the multipart upload, ignoring errors."""
        self.failed = self.failed or DestinationError(f"{self.key}: aborted")
        for f in self.parts:
            f.cancel()
        for f in self.parts:
            if not f.cancelled():
                f.exception()
        if self.buf is not None:
            self.dest.give_back(self.buf)
            self.buf = None
        if self.upload_id is not None:
            with contextlib.suppress(Exception):  # the next run's begin() aborts it too
                self.dest.s3.client.abort_multipart_upload(
                    Bucket=self.dest.location.bucket, Key=self.key, UploadId=self.upload_id
                )
            self.upload_id = None


class S3Destination(Destination):
    def __init__(
        self,
        uri: str,
        options: S3Options | None = None,
        *,
        open_files: int = 1,
    ) -> None:
        """``open_files``: objects written at once (one per rank for per-rank formats); each
        holds a part buffer while it fills, so many of them get smaller parts."""
        options = options or S3Options()
        part_bytes, concurrency = options.part_bytes, options.concurrency
        if part_bytes < MIN_PART_BYTES:
            raise SpecError(f"S3 part size must be at least {MIN_PART_BYTES} bytes (5 MiB)")
        fit = PART_BUFFER_BUDGET // (open_files + concurrency) // MiB * MiB
        part_bytes = max(MIN_PART_BYTES, min(part_bytes, fit))
        self.location = S3Location.parse(uri)
        if not self.location.prefix:
            raise ArtifactError(f"{uri}: an artifact needs a prefix (s3://BUCKET/PREFIX/)")
        self.uri = self.location.uri
        self.s3 = S3Client(options, concurrency=concurrency)
        self.artifact = S3Artifact(self.location, self.s3, workers=concurrency)
        """What is already there, read the way every reader reads an artifact."""
        self.part_bytes, self.concurrency = part_bytes, concurrency
        self.run_key = ""
        self.inflight = threading.BoundedSemaphore(concurrency)
        self._free: list[bytearray] = []
        self._free_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._present: dict[str, int] = {}
        self.reused: list[str] = []
        """Names of objects this run found complete and did not upload again."""

    # -- plumbing shared with the sinks ---------------------------------------------------

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, "s3-part")
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
        """One API call; botocore retries it, failures become one safe DestinationError."""
        return self.artifact.call(fn, key)

    def set_metadata(self, key: str, size: int, etag: str, extra: dict[str, str]) -> None:
        """Add metadata to a complete object by copying it onto itself (server side)."""
        client, bucket = self.s3.client, self.location.bucket
        metadata = {RUN_KEY: self.run_key, **extra}
        source = {"Bucket": bucket, "Key": key}
        if size <= COPY_LIMIT:
            self.call(
                lambda: client.copy_object(
                    Bucket=bucket,
                    Key=key,
                    CopySource=source,
                    CopySourceIfMatch=etag,
                    MetadataDirective="REPLACE",
                    Metadata=metadata,
                    ContentType=CONTENT_TYPE,
                ),
                key,
            )
            return
        self._copy_in_parts(key, size, etag, metadata)

    def _copy_in_parts(self, key: str, size: int, etag: str, metadata: dict[str, str]) -> None:
        client, bucket = self.s3.client, self.location.bucket
        upload = self.call(
            lambda: client.create_multipart_upload(
                Bucket=bucket, Key=key, Metadata=metadata, ContentType=CONTENT_TYPE
            ),
            key,
        )
        upload_id, step = upload["UploadId"], COPY_LIMIT

        def copy_part(number: int, start: int) -> dict[str, Any]:
            end = min(size, start + step) - 1
            got = with_retries(
                lambda: client.upload_part_copy(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource={"Bucket": bucket, "Key": key},
                    CopySourceIfMatch=etag,
                    CopySourceRange=f"bytes={start}-{end}",
                )
            )
            return {"PartNumber": number, "ETag": got["CopyPartResult"]["ETag"]}

        try:
            futures = [
                self.pool.submit(copy_part, i + 1, start)
                for i, start in enumerate(range(0, size, step))
            ]
            parts = [self.call(f.result, key) for f in futures]
            self.call(
                lambda: client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
                key,
            )
        except BaseException:
            with contextlib.suppress(Exception):
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            raise

    def _list(self) -> dict[str, int]:
        """{relative name: size} of every object under the prefix."""
        return {name: listed.size or 0 for name, listed in self.artifact.listing().items()}

    def _head(self, name: str) -> dict[str, Any]:
        key = self.location.key(name)
        return dict(
            self.call(lambda: self.s3.client.head_object(Bucket=self.location.bucket, Key=key), key)
        )

    # -- the Destination interface --------------------------------------------------------

    def existing(self) -> Manifest | None:
        """The committed manifest, if any. Objects without one are a run to resume, not an
        artifact; they are reused or replaced object by object (see the module docstring)."""
        return self.artifact.read_manifest()

    def begin(self, run_key: str = "") -> None:
        self.run_key = run_key
        self._present = self._list()
        client, bucket = self.s3.client, self.location.bucket
        stale = self.call(
            lambda: client.list_multipart_uploads(Bucket=bucket, Prefix=self.location.prefix + "/"),
            self.location.prefix,
        )
        for upload in stale.get("Uploads", []):
            self.call(
                lambda u=upload: client.abort_multipart_upload(
                    Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]
                ),
                upload["Key"],
            )

    def begin_shared(
        self, run_key: str, *, finalize: bool = False, params: Mapping[str, Any] | None = None
    ) -> None:
        """Workers write their objects under the prefix itself, like one stager does; unlike
        ``begin`` a worker must not abort multipart uploads, which may be another worker's.
        The finalize step runs when every worker is done, so it aborts leftovers."""
        if finalize:
            self.begin(run_key)
            return
        self.run_key = run_key
        self._present = self._list()

    def check_part(self, name: str, size: int) -> FileDigest:
        """A part is complete when its object has this run's key, the size and a content
        hash that its bytes, read back, hash to (``completed``)."""
        found = self.completed(name, size)
        if found is None:
            state = "has the wrong size or run" if name in self._present else "is missing"
            raise ArtifactError(
                f"{self.uri_of(name)} {state} (expected {size} bytes from this run: workers and "
                "finalize must run the same stager with the same arguments, --max-part-bytes "
                "included); rerun the worker that owns it (`modelstage stage --group i/n`), "
                "then finalize again"
            )
        return found

    def release(self) -> None:
        self._shutdown()

    def completed(self, name: str, size: int) -> FileDigest | None:
        """The digest of an object an earlier run of this run key finished, else None: the
        object is read back and must hash to the root its metadata records (an object that
        does not is written again)."""
        if self._present.get(name) != size:
            self._refuse_foreign(name)
            return None
        head = self._head(name)
        meta = head.get("Metadata", {})
        self._refuse_foreign(name, meta)
        root, chunk = str(meta.get(HASH_KEY, "")), str(meta.get(CHUNK_KEY, ""))
        if meta.get(RUN_KEY) != self.run_key or not _HEX64.match(root) or not chunk.isdigit():
            return None
        if int(chunk) < 1:
            return None
        etag = str(head.get("ETag", "")).strip('"')
        read_into = self.artifact.read_into(name, etag)
        job = FileToHash(self.uri_of(name), size, read_into, chunk_bytes=int(chunk))
        digest = hash_files([job], workers=self.concurrency)[0][0]
        if digest.root != root:
            print(
                f"s3: {self.uri_of(name)} does not hash to its recorded content hash; "
                "writing it again",
                file=sys.stderr,
            )
            return None
        self.reused.append(name)
        return digest

    def _refuse_foreign(self, name: str, meta: dict[str, str] | None = None) -> None:
        if name not in self._present:
            return
        if meta is None:
            meta = self._head(name).get("Metadata", {})
        if RUN_KEY not in meta:
            raise ArtifactError(
                f"{self.uri_of(name)} exists and was not written by modelstage; it is never "
                "overwritten: remove it or choose another --out"
            )

    def open_sink(self, name: str, size: int) -> S3ObjectSink:
        return S3ObjectSink(self, name, size)

    def write_small(self, name: str, data: bytes) -> FileDigest:
        digest = digest_bytes(data, self.chunk_bytes)
        if self._present.get(name) == len(data):
            meta = self._head(name).get("Metadata", {})
            self._refuse_foreign(name, meta)
            if meta.get(HASH_KEY) == digest.root and meta.get(CHUNK_KEY) == str(self.chunk_bytes):
                self.reused.append(name)
                return digest
        else:
            self._refuse_foreign(name)
        return super().write_small(name, data)

    def commit(self, manifest: Manifest) -> None:
        present = self._list()
        missing = sorted(n for n in manifest.files if n not in present)
        stray = sorted(n for n in present if n not in manifest.files and n != MANIFEST)
        if missing:
            raise DestinationError(f"{self.uri}: objects vanished while staging: {missing[:5]}")
        if stray:
            raise ArtifactError(
                f"{self.uri} holds objects that are not part of this artifact "
                f"({', '.join(stray[:5])}); remove them or choose another --out"
            )
        data = manifest.to_json().encode()
        root = digest_bytes(data, self.chunk_bytes).root
        meta = {HASH_KEY: root, CHUNK_KEY: str(self.chunk_bytes)}
        self.call(
            lambda: self.s3.client.put_object(
                Bucket=self.location.bucket,
                Key=self.location.key(MANIFEST),
                Body=data,
                ContentType="application/json",
                Metadata={**meta, RUN_KEY: self.run_key},
            ),
            self.location.key(MANIFEST),
        )
        self._shutdown()
        if self.reused:
            print(
                f"s3: reused {len(self.reused)} complete object(s) of an earlier run",
                file=sys.stderr,
            )

    def abort(self) -> None:
        """Stop writing. Complete objects stay: invisible without the manifest, a rerun of
        the same run key reuses them instead of uploading them again."""
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._free.clear()
