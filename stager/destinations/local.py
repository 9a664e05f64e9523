"""A local directory (also a mounted PVC) as the artifact location.

Work happens in a sibling ``<out>.tmp-<id>`` on the same filesystem; every file is fsynced,
the manifest is written last, then one ``rename`` publishes the directory. A lock file keeps
two stagers from racing on the same location; leftovers of killed runs are removed under it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from pathlib import Path

from ..aligned_io import DIRECT_MIN_BYTES, AlignedWriter, buffer_bytes_for
from ..errors import ArtifactError, DestinationError
from ..integrity import (
    DEFAULT_CHUNK_BYTES,
    ChunkedHasher,
    ChunkMismatch,
    FileDigest,
    hash_local_files,
)
from ..manifest import MANIFEST, Manifest, read_manifest
from ..pieces import Piece
from .base import Destination


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalFileSink:
    """Appends to a new file, hashing as it goes; ``close`` fsyncs and checks the size.

    Bytes are gathered into page-aligned buffers and written with ``O_DIRECT`` where the
    filesystem allows it: the disk reads them straight from our buffer, so the kernel spends
    no CPU copying them into the page cache (measured here: a buffered write + fsync of 4 GiB
    costs 2.7 s of system time, a direct one 0.5 s), the staged artifact does not crowd the
    node's page cache (and the Job's memory cgroup), and the CPU is left for the chunk hashes
    (BLAKE3), which the manifest needs for every byte. While one buffer is being written,
    this thread hashes and fills the next. Without ``O_DIRECT`` (tmpfs, some FUSE mounts)
    the same buffers go through the page cache.
    """

    def __init__(self, path: Path, size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
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
        self.hash = ChunkedHasher(chunk_bytes)
        self.out = AlignedWriter(
            self.fd, direct=size >= DIRECT_MIN_BYTES, buffer_bytes=buffer_bytes_for(size)
        )

    def write(self, data: Piece) -> None:
        self.written += self.out.write(data, self.hash)

    def close(self) -> FileDigest:
        if self.written != self.expected:
            raise AssertionError(f"{self.path}: wrote {self.written} of {self.expected} bytes")
        self.out.finish(self.written)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        return self.hash.finish()

    def abort(self) -> None:
        self.out.release()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


SIDECAR_SUFFIX = ".part.json"
"""Beside each part a scale-out worker finished: its size, chunk hashes and run key."""
PARTIAL_INFIX = ".partial-"


class AtomicFileSink(LocalFileSink):
    """A file that appears under its name only once complete: written to a temporary name,
    fsynced, then renamed (with a sidecar recording size and chunk hashes first, when asked).

    Scale-out workers share one work directory, and one may be killed at any byte: a file
    under its final name is therefore always whole, and its sidecar says so.
    """

    def __init__(
        self, path: Path, size: int, sidecar: dict[str, str] | None, chunk_bytes: int
    ) -> None:
        self.final, self.sidecar = path, sidecar
        temporary = path.with_name(f"{path.name}{PARTIAL_INFIX}{uuid.uuid4().hex[:8]}")
        super().__init__(temporary, size, chunk_bytes)

    def close(self) -> FileDigest:
        digest = super().close()
        if self.sidecar is not None:
            record = {"size": digest.size, "blake3": digest.root, "chunkBytes": digest.chunk_bytes,
                      "chunks": list(digest.chunks), **self.sidecar}  # fmt: skip
            _write_durably(sidecar_path(self.final), json.dumps(record).encode())
        os.rename(self.path, self.final)
        fsync_dir(self.final.parent)
        return digest

    def abort(self) -> None:
        super().abort()
        self.path.unlink(missing_ok=True)


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}{PARTIAL_INFIX}{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


class LocalDestination(Destination):
    def __init__(self, out: str) -> None:
        self.out = Path(out).absolute()
        self.uri = str(self.out)
        self.work: Path | None = None
        self._lock_fd = -1
        self.run_key = ""
        self.shared = self.finalizing = False

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

    # -- scale-out: workers share one deterministic work directory (scale_out.py) --------

    def shared_work(self, run_key: str) -> Path:
        """``<out>.tmp-shared-<key>``: every worker and the finalize step of one run compute
        the same name; another run key (stager version, source, part size) gets another."""
        return self.out.parent / f"{self.out.name}.tmp-shared-{run_key[:16]}"

    def begin_shared(self, run_key: str, *, finalize: bool = False) -> None:
        """Join the run's shared work directory: workers under a shared lock (any number at
        once, never beside a one-pod stager, which locks exclusively), the finalize step
        under the exclusive lock, and only when some worker has written something."""
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(parent / f".{self.out.name}.lock", os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise DestinationError(f"{parent}: cannot write: {e.strerror}") from None
        try:
            mode = fcntl.LOCK_EX if finalize else fcntl.LOCK_SH
            fcntl.flock(self._lock_fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            self._unlock()
            raise DestinationError(
                f"{self.out}: another stager is writing this artifact right now"
                + (" (a worker is still running?)" if finalize else "")
            ) from None
        self.run_key, self.shared = run_key, True
        self.work = self.shared_work(run_key)
        if finalize:
            if not self.work.is_dir():
                self._unlock()
                raise ArtifactError(
                    f"{self.work}: no worker has written this artifact; run the "
                    "`modelstage stage --group i/n` workers first"
                )
            self.finalizing = True
        else:
            self.work.mkdir(exist_ok=True)

    def completed(self, name: str, size: int) -> FileDigest | None:
        """A part a worker of this run finished: renamed into place with its sidecar. Its
        bytes are checked by ``check_part`` at finalize (a worker's rerun only skips it)."""
        if self.work is None or not self.shared:
            return None
        path = self.work / name
        try:
            record = json.loads(sidecar_path(path).read_bytes())
            on_disk = os.stat(path).st_size
        except (FileNotFoundError, ValueError):
            return None
        if record.get("runKey") != self.run_key or record.get("size") != size or on_disk != size:
            return None
        try:
            digest = FileDigest(size, int(record["chunkBytes"]), tuple(map(str, record["chunks"])))
        except (KeyError, TypeError, ValueError):
            return None  # a sidecar of another stager version: write the part again
        return digest if digest.root == record.get("blake3") else None

    def check_part(self, name: str, size: int) -> FileDigest:
        """Finalize: the part must be complete, and its bytes must hash to its sidecar's."""
        found = self.completed(name, size)
        assert self.work is not None
        path = self.work / name
        if found is None:
            state = "has the wrong size" if path.exists() else "is missing"
            raise ArtifactError(
                f"{path} {state} (expected {size} bytes from this run); rerun the worker "
                "that owns it (`modelstage stage --group i/n`), then finalize again"
            )
        try:
            hash_local_files([path], [found], recorded="its worker's sidecar")
        except ChunkMismatch as e:
            raise ArtifactError(
                f"{path}: {e.reason}: delete it and rerun its worker, then finalize again"
            ) from None
        return found

    def open_sink(self, name: str, size: int) -> LocalFileSink:
        assert self.work is not None
        if self.shared:
            sidecar = None if self.finalizing else {"runKey": self.run_key}
            return AtomicFileSink(self.work / name, size, sidecar, self.chunk_bytes)
        return LocalFileSink(self.work / name, size, self.chunk_bytes)

    def release(self) -> None:
        """A worker is done: leave the shared work directory to the others and finalize."""
        self.work = None
        self._unlock()

    def commit(self, manifest: Manifest) -> None:
        assert self.work is not None
        if self.shared:  # drop sidecars and leftovers: the directory holds what it lists
            for path in self.work.iterdir():
                if path.name not in manifest.files:
                    path.unlink()
        self.write_small(MANIFEST, manifest.to_json().encode())
        fsync_dir(self.work)
        if self.out.exists():
            raise ArtifactError(f"{self.out} appeared while staging; leaving it untouched")
        os.rename(self.work, self.out)
        fsync_dir(self.out.parent)
        self.work = None
        if self.shared:  # leftovers of other runs; no worker of theirs can hold the lock now
            for stale in self.out.parent.glob(f"{self.out.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        self._unlock()

    def abort(self) -> None:
        if self.shared:  # parts already renamed into place stay for a rerun to reuse
            self.release()
            return
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
