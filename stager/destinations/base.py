"""The interface of an artifact destination: sinks, a commit point, and a way to abort."""

from __future__ import annotations

import abc

from ..manifest import Manifest
from ..rank_writer import Sink


class Destination(abc.ABC):
    """An artifact being written. Nothing is visible as complete before ``commit``."""

    uri: str

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

    def completed(self, name: str, size: int) -> tuple[int, str] | None:
        """(size, sha256) of ``name`` when an earlier run with this run key already wrote
        it completely, so it need not be written again; None means write it."""
        return None

    @abc.abstractmethod
    def open_sink(self, name: str, size: int) -> Sink: ...

    def write_small(self, name: str, data: bytes) -> tuple[int, str]:
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
