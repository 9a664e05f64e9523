"""The interface of an artifact destination: sinks, a commit point, and a way to abort.

Writers (``writers/``) write through ``Sink``s a destination opens; they know nothing else of
where the bytes go.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from modelstage.core.errors import SpecError
from modelstage.core.integrity import DEFAULT_CHUNK_BYTES, FileDigest
from modelstage.core.manifest import Manifest

from ..pieces import Piece


class Sink(Protocol):
    """One output file being written front to back (a local file, an S3 multipart upload)."""

    def write(self, data: Piece) -> None: ...

    def close(self) -> FileDigest:
        """Finish durably; returns the file's size and chunk hashes."""
        ...

    def abort(self) -> None: ...


OpenSink = Callable[[str, int], Sink]
"""(file name, exact final size) -> Sink."""
Completed = Callable[[str, int], FileDigest | None]
"""(file name, exact final size) -> the digest of a file already complete, else None."""


class Destination(abc.ABC):
    """An artifact being written. Nothing is visible as complete before ``commit``."""

    uri: str
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """The chunk size of the content hashes of the files this run writes."""
    address: str | None = None
    """Where the committed artifact is pinned, when that is not ``uri``: an OCI image's
    ``REGISTRY/REPOSITORY@sha256:...`` (a tag can move; the digest cannot)."""

    @abc.abstractmethod
    def existing(self) -> Manifest | None:
        """The manifest of a complete artifact already at the location, if any.

        Raises ArtifactError when the location holds something incomplete or foreign, which
        is never overwritten silently.
        """

    @abc.abstractmethod
    def begin(self, run_key: str = "") -> None:
        """Prepare a private work area and clean up leftovers of killed runs.

        ``run_key`` pins the bytes this run writes (digest, source identity, stager
        version); a destination that can resume reuses objects written under the same key.
        """

    def completed(self, name: str, size: int) -> FileDigest | None:
        """The digest of ``name`` when an earlier run with this run key already wrote it
        completely (its bytes checked), so it need not be written again; None: write it."""
        return None

    # -- scale-out (scale_out.py): several workers write parts, one finalize step commits ---

    def begin_shared(
        self, run_key: str, *, finalize: bool = False, params: Mapping[str, Any] | None = None
    ) -> None:
        """Join the work area that every worker of ``run_key`` shares (or, with ``finalize``,
        take it over once they are done). Parts a worker finishes stay there, complete, for
        a rerun to reuse and for the finalize step to check. ``params`` are the settings the
        run key pins (part size, stager version, source), recorded so that a finalize with
        other settings can say which one differs."""
        raise SpecError(f"{self.uri}: this destination cannot be staged by several workers")

    def check_part(self, name: str, size: int) -> FileDigest:
        """Finalize: the digest of a part a worker finished, its bytes re-hashed against
        what the worker recorded; ArtifactError otherwise."""
        raise SpecError(f"{self.uri}: this destination cannot be staged by several workers")

    @abc.abstractmethod
    def release(self) -> None:
        """A worker is done: leave the shared work area to the others and to finalize."""

    @abc.abstractmethod
    def open_sink(self, name: str, size: int) -> Sink: ...

    def write_small(self, name: str, data: bytes) -> FileDigest:
        """Write a small file (config, tokenizer, manifest) durably into the work area."""
        sink = self.open_sink(name, len(data))
        sink.write(memoryview(data))
        return sink.close()

    @abc.abstractmethod
    def commit(self, manifest: Manifest) -> None:
        """Write the manifest last and make the artifact visible atomically."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Remove the work area; safe to call at any point."""
