"""A local directory (also a mounted PVC) as the artifact location.

Work happens in a sibling ``<out>.tmp-<id>`` on the same filesystem; every file is fsynced,
the manifest is written last, then one ``rename`` publishes the directory. A lock file keeps
two stagers from racing on the same location; leftovers of killed runs are removed under it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import uuid
from pathlib import Path

from ..errors import ArtifactError, DestinationError
from ..manifest import MANIFEST, Manifest, read_manifest
from .base import Destination


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalFileSink:
    """Appends to a new file, hashing as it goes; ``close`` fsyncs and checks the size."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.expected = path, size
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        if size:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as e:
                os.close(self.fd)
                raise DestinationError(
                    f"{path}: cannot reserve {size} bytes: {e.strerror}"
                ) from None
        self.written = 0
        self.hash = hashlib.sha256()

    def write(self, data: memoryview) -> None:
        self.hash.update(data)
        view = data
        while len(view):
            n = os.write(self.fd, view)
            view = view[n:]
        self.written += len(data)

    def close(self) -> tuple[int, str]:
        if self.written != self.expected:
            raise AssertionError(f"{self.path}: wrote {self.written} of {self.expected} bytes")
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        return self.written, self.hash.hexdigest()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalDestination(Destination):
    def __init__(self, out: str) -> None:
        self.out = Path(out).absolute()
        self.uri = str(self.out)
        self.work: Path | None = None
        self._lock_fd = -1

    def existing(self) -> Manifest | None:
        if not self.out.exists():
            return None
        if not self.out.is_dir():
            raise ArtifactError(f"{self.out} exists and is not a directory; choose another --out")
        manifest = read_manifest(self.out)
        if manifest is None:
            raise ArtifactError(
                f"{self.out} exists but holds no {MANIFEST}: an incomplete or foreign artifact; "
                "it is never overwritten: remove it or choose another --out"
            )
        return manifest

    def begin(self, run_key: str = "") -> None:
        """A local run never resumes: ``rename`` publishes all at once, leftovers are removed."""
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(parent / f".{self.out.name}.lock", os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise DestinationError(f"{parent}: cannot write: {e.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DestinationError(
                f"{self.out}: another stager is writing this artifact right now"
            ) from None
        for stale in parent.glob(f"{self.out.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.work = parent / f"{self.out.name}.tmp-{uuid.uuid4().hex[:12]}"
        self.work.mkdir()

    def open_sink(self, name: str, size: int) -> LocalFileSink:
        assert self.work is not None
        return LocalFileSink(self.work / name, size)

    def commit(self, manifest: Manifest) -> None:
        assert self.work is not None
        self.write_small(MANIFEST, manifest.to_json().encode())
        fsync_dir(self.work)
        if self.out.exists():
            raise ArtifactError(f"{self.out} appeared while staging; leaving it untouched")
        os.rename(self.work, self.out)
        fsync_dir(self.out.parent)
        self.work = None
        self._unlock()

    def abort(self) -> None:
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
