"""An OCI registry as the artifact location: ``--out oci://REGISTRY/REPOSITORY:TAG``.

Each artifact file becomes one uncompressed layer (``core/oci_image.py`` says how, and in
which of the two forms), streamed to the registry with the distribution API's chunked upload
(``POST``, then ``PATCH`` per filled buffer, then ``PUT ?digest=``): the layer's sha256 and
the file's BLAKE3 chunk hashes are computed from the buffer on its way out, so no byte is
read twice, and the registry itself refuses a layer whose bytes do not hash to the digest.
Memory is bounded: per open file one buffer filling and at most ``IN_FLIGHT`` being sent.

A file small enough to fit one buffer is hashed first and skipped when the registry already
holds its blob (``HEAD``); so are the config and ``modelstage.json``. A rank file is streamed
(its digest is known only at its end). Pushing the artifact that the tag already names
uploads nothing at all (``existing``).

**The commit point** is the image manifest ``PUT`` to the tag, pushed last: blobs without a
manifest are invisible (and the registry's garbage collection removes them). The pushed
manifest's digest is the artifact's address, ``REGISTRY/REPOSITORY@sha256:...``
(``address``); pin that, never the tag.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np
from modelstage.core.errors import ArtifactError, DestinationError, SpecError
from modelstage.core.integrity import ChunkedHasher, FileDigest
from modelstage.core.location import OciArtifact
from modelstage.core.manifest import MANIFEST, Manifest
from modelstage.core.oci_image import (
    DEFAULT_FORM,
    DIGEST_ANNOTATION,
    FORMS,
    MANIFEST_ANNOTATION,
    Layer,
    image_config,
    image_manifest,
    tar_header,
    tar_trailer,
)
from modelstage.core.oci_registry import (
    OCI_MANIFEST,
    OciReference,
    RegistryClient,
    RegistryError,
    RegistryOptions,
)

from ..pieces import Piece, copy_piece, piece_nbytes
from .base import Destination

MiB = 1024 * 1024
BUFFER_BYTES = 16 * MiB
"""One ``PATCH`` at most: large enough to amortise a request."""
MIN_BUFFER_BYTES = 4 * MiB
IN_FLIGHT = 2
"""Buffers per file being sent while the next fills."""
BUFFER_BUDGET = 192 * MiB
"""Buffers of one run: (1 + ``IN_FLIGHT``) per open file (16 MiB up to 4 open files, smaller
beyond, down to 4 MiB)."""
T = TypeVar("T")


class OciLayerSink:
    """One artifact file streamed into one layer blob."""

    def __init__(self, dest: OciDestination, name: str, size: int) -> None:
        self.dest, self.name, self.size = dest, name, size
        self.media_type = dest.form.media_type(name)
        self.head = tar_header(name, size) if dest.form.tar else b""
        self.tail = tar_trailer(size) if dest.form.tar else b""
        self.layer_size = len(self.head) + size + len(self.tail)
        self.blake3 = ChunkedHasher(dest.chunk_bytes)
        self.sha256 = hashlib.sha256(self.head)
        self.buf = bytearray(min(dest.buffer_bytes, self.layer_size))
        self.buf[: len(self.head)] = self.head  # a tar header is far below one buffer
        self.fill, self.written = len(self.head), 0
        self.queued = 0
        """Layer bytes handed to the sender so far: where the next ``PATCH`` starts."""
        self.location: str | None = None
        self.sender: ThreadPoolExecutor | None = None
        self.sent: list[Future[None]] = []
        self.slots = threading.BoundedSemaphore(IN_FLIGHT)
        self.failed: BaseException | None = None

    def write(self, data: Piece) -> None:
        if self.failed is not None:
            raise self.failed
        total = piece_nbytes(data)
        if self.written + total > self.size:
            raise AssertionError(f"{self.name}: more than the announced {self.size} bytes")
        done = 0
        while done < total:
            space = np.frombuffer(self.buf, dtype=np.uint8)[self.fill :]
            n = copy_piece(data, done, space)
            chunk = space[:n].data
            self.blake3.update(chunk)
            self.sha256.update(chunk)
            self.fill, done = self.fill + n, done + n
            if self.fill == len(self.buf) and self.written + done < self.size:
                self._send_buffer()
        self.written += total

    def _send_buffer(self) -> None:
        """Hand the full buffer to this file's sender thread and continue in a fresh one."""
        client = self.dest.client
        if self.location is None:
            self.location = self.dest.call(client.start_upload, self.name)
            self.sender = ThreadPoolExecutor(1, f"oci-{self.name[:20]}")
        assert self.sender is not None
        buf, fill, start = self.buf, self.fill, self.queued
        self.slots.acquire()  # backpressure: at most IN_FLIGHT buffers per file
        self.sent.append(self.sender.submit(self._patch, buf, fill, start))
        self.buf, self.fill, self.queued = bytearray(len(buf)), 0, start + fill

    def _patch(self, buf: bytearray, fill: int, start: int) -> None:
        try:
            if self.failed is not None:
                raise self.failed
            assert self.location is not None
            data = memoryview(buf)[:fill]
            self.location = self.dest.call(
                lambda: self.dest.client.append(self.location or "", start, data), self.name
            )
        except BaseException as e:
            self.failed = self.failed or e
            raise
        finally:
            self.slots.release()

    def close(self) -> FileDigest:
        if self.written != self.size:
            raise AssertionError(f"{self.name}: wrote {self.written} of {self.size} bytes")
        tail = self.tail
        self.sha256.update(tail)
        digest = "sha256:" + self.sha256.hexdigest()
        last = bytes(memoryview(self.buf)[: self.fill]) + tail
        for f in self.sent:
            f.result()
        if self.failed is not None:
            raise self.failed
        client = self.dest.client
        held = (
            None if self.location else self.dest.call(lambda: client.blob_size(digest), self.name)
        )
        if held == self.layer_size:  # hashed before any byte went out: the registry has it
            self.dest.skipped.append(self.name)
        else:
            location = self.location or self.dest.call(client.start_upload, self.name)
            self.location = None
            self.dest.call(
                lambda: client.finish_upload(location, digest, memoryview(last)), self.name
            )
            self.dest.uploaded.append(self.name)
        self._stop()
        offset = len(self.head)
        self.dest.layers[self.name] = Layer(
            self.name, digest, self.layer_size, self.media_type, offset, self.size
        )
        return self.blake3.finish()

    def _stop(self) -> None:
        if self.sender is not None:
            self.sender.shutdown(wait=True, cancel_futures=True)
            self.sender = None

    def abort(self) -> None:
        self.failed = self.failed or DestinationError(f"{self.name}: aborted")
        self._stop()
        if self.location is not None:
            self.dest.client.cancel_upload(self.location)
            self.location = None


class OciDestination(Destination):
    def __init__(
        self,
        uri: str,
        options: RegistryOptions | None = None,
        *,
        form: str = DEFAULT_FORM,
        open_files: int = 1,
    ) -> None:
        """``open_files``: files written at once (one per rank for per-rank formats)."""
        fit = BUFFER_BUDGET // (max(1, open_files) * (1 + IN_FLIGHT)) // MiB * MiB
        self.buffer_bytes = max(MIN_BUFFER_BYTES, min(BUFFER_BYTES, fit))
        try:
            self.ref = OciReference.parse(uri)
        except RegistryError as e:
            raise SpecError(f"--out: {e}") from None
        if self.ref.digest is not None or self.ref.tag is None:
            raise SpecError(
                f"--out {uri}: push to a tag (oci://REGISTRY/REPOSITORY:TAG); the pushed "
                "image's digest is the result, printed as its address"
            )
        if form not in FORMS:
            raise SpecError(f"--oci-form {form!r}: one of {', '.join(FORMS)}")
        self.form, self.options = FORMS[form], options or RegistryOptions()
        self.uri = self.ref.uri
        self._client: RegistryClient | None = None  # built on first use: `plan` is offline
        self.layers: dict[str, Layer] = {}
        self.uploaded: list[str] = []
        self.skipped: list[str] = []

    @property
    def client(self) -> RegistryClient:
        if self._client is None:
            self._client = self.call(lambda: RegistryClient(self.ref, self.options), self.uri)
        return self._client

    def call(self, fn: Callable[[], T], what: str) -> T:
        """One registry operation; its failure is one credential-free DestinationError."""
        try:
            return fn()
        except RegistryError as e:
            raise DestinationError(f"{self.uri} ({what}): {e}") from None

    def existing(self) -> Manifest | None:
        """The artifact the tag names, when it is one modelstage pushed; a tag holding any
        other image is never moved silently."""
        found = OciArtifact(self.ref, self.options)
        image = found.image()
        if image is None:
            return None
        manifest = found.read_manifest()
        if manifest is None:
            raise ArtifactError(
                f"{self.uri} names an image that modelstage did not push (no "
                f"{MANIFEST_ANNOTATION} annotation); it is never overwritten: choose another tag"
            )
        self.address = self.ref.pinned(image.digest)
        return manifest

    def begin(self, run_key: str = "") -> None:
        self.call(self.client.ping, "GET /v2/")

    def release(self) -> None:
        """Scale-out is not offered for registries (``begin_shared`` refuses)."""

    def open_sink(self, name: str, size: int) -> OciLayerSink:
        if "/" in name:
            raise DestinationError(f"{name}: artifact files are flat; a layer title is a name")
        return OciLayerSink(self, name, size)

    def write_small(self, name: str, data: bytes) -> FileDigest:
        sink = self.open_sink(name, len(data))
        sink.write(memoryview(data))
        return sink.close()

    def commit(self, manifest: Manifest) -> None:
        """Push ``modelstage.json`` and the config, then the image manifest, last."""
        missing = sorted(set(manifest.files) - set(self.layers))
        if missing:
            raise DestinationError(f"{self.uri}: files were not pushed: {missing[:5]}")
        data = manifest.to_json().encode()
        self.write_small(MANIFEST, data)
        layers = [self.layers[n] for n in sorted(self.layers)]
        info = {
            "createdAt": manifest.createdAt,
            "source": manifest.source.get("uri"),
            "revision": manifest.source.get("revision"),
            "format": manifest.format,
            "dtype": manifest.dtype,
            "digest": manifest.digest,
        }
        config = image_config(self.form, layers, info)
        config_digest, _ = self.call(lambda: self.client.put_blob(config), "config")
        annotations = {
            MANIFEST_ANNOTATION: self.layers[MANIFEST].digest,
            DIGEST_ANNOTATION: manifest.digest,
            "org.opencontainers.image.created": manifest.createdAt,
        }
        body = image_manifest(self.form, (config_digest, len(config)), layers, annotations)
        tag = self.ref.tag or ""
        pushed = self.call(lambda: self.client.put_manifest(tag, body, OCI_MANIFEST), "manifest")
        self.address = self.ref.pinned(pushed)
        print(
            f"oci: pushed {self.address} ({len(self.uploaded)} layer(s) uploaded, "
            f"{len(self.skipped)} already in the registry)",
            file=sys.stderr,
        )

    def abort(self) -> None:
        """Nothing to remove: blobs without a manifest are not an artifact."""
