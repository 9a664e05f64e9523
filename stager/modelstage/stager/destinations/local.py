"""A local directory (also a mounted PVC) as the artifact location.

Work happens in a sibling ``<out>.tmp-<id>`` on the same filesystem; every file is fsynced,
the manifest is written last, then one ``rename`` publishes the directory. A lock file keeps
two stagers from racing on the same location; leftovers of killed runs are removed under it,
and the lock file itself goes when its last holder leaves (``LocationLock``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelstage.core.durable import fsync_dir, write_atomic
from modelstage.core.errors import ArtifactError, DestinationError
from modelstage.core.integrity import (
    DEFAULT_CHUNK_BYTES,
    ChunkedHasher,
    ChunkMismatch,
    FileDigest,
    hash_local_files,
)
from modelstage.core.manifest import MANIFEST, Manifest, read_manifest

from ..aligned_io import DIRECT_MIN_BYTES, AlignedWriter, buffer_bytes_for
from ..pieces import Piece
from .base import Destination


def open_lock(path: Path) -> int:
    """The location's lock file, created when missing, never through a symbolic link (one
    planted there would have the stager create or truncate a file elsewhere)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DestinationError(
                f"{path}: the lock file is a symbolic link; refusing to follow it (remove it)"
            ) from None
        raise DestinationError(f"{path.parent}: cannot write: {e.strerror}") from None


def remove_leftover(path: Path) -> int:
    """Remove a ``<out>.tmp-*`` leftover of a killed run; returns the files it held. A link
    or a file under that name is removed itself, never followed."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return 1
    count = sum(len(files) for _, _, files in os.walk(path))  # os.walk follows no links
    shutil.rmtree(path)
    return count


class LocalFileSink:
    """Appends to a new file, hashing as it goes; ``close`` fsyncs and checks the size.

    Bytes are gathered into page-aligned buffers and written with ``O_DIRECT`` where the
    filesystem allows it: the disk reads them straight from our buffer, so the kernel spends
    no CPU copying them into the page cache (a buffered write + fsync of 4 GiB costs 2.7 s of
    system time, a direct one 0.5 s: docs/performance.md), the staged artifact does not crowd the
    node's page cache (and the Job's memory cgroup), and the CPU is left for sha256, which the
    manifest needs for every byte. While one buffer is being written, this thread hashes and
    fills the next. Without ``O_DIRECT`` (tmpfs, some FUSE mounts) the same buffers go
    through the page cache.
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


class LocationLock:
    """``<parent>/.<name>.lock``: an ``flock`` that one-pod stagers and finalize take
    exclusively, scale-out workers shared, deletes exclusively; always non-blocking (a busy
    location is an error to retry, never a wait).

    The file is removed by the last holder, so nothing stays beside a finished artifact. That
    is race-free because removal needs the exclusive lock and every taker checks, once it holds
    the lock, that the path still names the file it locked; one that locked a file unlinked in
    between starts over on the new one.
    """

    def __init__(self, out: Path) -> None:
        self.path = out.parent / f".{out.name}.lock"
        self.fd = -1

    def acquire(self, *, exclusive: bool) -> bool:
        """Take the lock; False when another process holds it in a conflicting mode."""
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        while True:
            fd = open_lock(self.path)
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return True
            os.close(fd)  # locked a file its last holder had just removed: take the new one

    def release(self) -> None:
        """Leave; the last holder (the only one that can lock exclusively) removes the file."""
        if self.fd < 0:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path.unlink(missing_ok=True)
        except BlockingIOError:
            pass  # other holders remain; the last one removes it
        finally:
            os.close(self.fd)
            self.fd = -1

    @property
    def held(self) -> bool:
        return self.fd >= 0


RUN_RECORD = ".modelstage-run.json"
"""In a shared work directory: the settings its run key pins (see ``begin_shared``)."""
SIDECAR_MAX_BYTES = 4096
"""A sidecar is one short JSON line; more is not one of ours (and does not parse)."""
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
            record = {
                "size": digest.size,
                "blake3": digest.root,
                "chunkBytes": digest.chunk_bytes,
                "chunks": list(digest.chunks),
                **self.sidecar,
            }
            write_atomic(sidecar_path(self.final), json.dumps(record).encode(), 0o644)
        os.rename(self.path, self.final)
        fsync_dir(self.final.parent)
        return digest

    def abort(self) -> None:
        super().abort()
        self.path.unlink(missing_ok=True)


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


class LocalDestination(Destination):
    def __init__(self, out: str) -> None:
        self.out = Path(out).absolute()
        self.uri = str(self.out)
        self.work: Path | None = None
        self._lock = LocationLock(self.out)
        self.run_key = ""
        self.shared = self.finalizing = False

    def existing(self) -> Manifest | None:
        if not self.out.exists():
            return None
        if not self.out.is_dir():
            raise ArtifactError(f"{self.out} exists and is not a directory; choose another --out")
        manifest = read_manifest(self.out)
        if manifest is None:
            names = sorted(p.name for p in self.out.iterdir())
            more = ", ..." if len(names) > 3 else ""
            count = f"{len(names)} {'entry' if len(names) == 1 else 'entries'}"
            held = f"{count}: {', '.join(names[:3])}{more}" if names else "empty"
            raise ArtifactError(
                f"{self.out} exists but holds no {MANIFEST} ({held}): an incomplete or foreign "
                "artifact; it is never overwritten: remove it or choose another --out"
            )
        return manifest

    def begin(self, run_key: str = "") -> None:
        """A local run never resumes: ``rename`` publishes all at once, leftovers are removed."""
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            locked = self._lock.acquire(exclusive=True)
        except OSError as e:
            raise DestinationError(f"{parent}: cannot write: {e.strerror}") from None
        if not locked:
            raise DestinationError(f"{self.out}: another stager is writing this artifact right now")
        for stale in parent.glob(f"{self.out.name}.tmp-*"):
            with contextlib.suppress(OSError):
                remove_leftover(stale)
        self.work = parent / f"{self.out.name}.tmp-{uuid.uuid4().hex[:12]}"
        self.work.mkdir()

    # -- scale-out: workers share one deterministic work directory (scale_out.py) --------

    def shared_work(self, run_key: str) -> Path:
        """``<out>.tmp-shared-<key>``: every worker and the finalize step of one run compute
        the same name; another run key (stager version, source, part size) gets another."""
        return self.out.parent / f"{self.out.name}.tmp-shared-{run_key[:16]}"

    def begin_shared(
        self, run_key: str, *, finalize: bool = False, params: Mapping[str, Any] | None = None
    ) -> None:
        """Join the run's shared work directory: workers under a shared lock (any number at
        once, never beside a one-pod stager, which locks exclusively), the finalize step
        under the exclusive lock, and only when some worker has written something."""
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            locked = self._lock.acquire(exclusive=finalize)
        except OSError as e:
            raise DestinationError(f"{parent}: cannot write: {e.strerror}") from None
        if not locked:
            raise DestinationError(
                f"{self.out}: another stager is writing this artifact right now"
                + (" (a worker is still running?)" if finalize else "")
            ) from None
        self.run_key, self.shared = run_key, True
        self.work = self.shared_work(run_key)
        if finalize:
            if not self.work.is_dir():
                self._unlock()
                raise ArtifactError(self._no_work_reason(params or {}))
            self.finalizing = True
        else:
            self.work.mkdir(exist_ok=True)
            record = self.work / RUN_RECORD
            if params and not record.exists():
                write_atomic(record, json.dumps(dict(params), sort_keys=True).encode(), 0o644)

    def _no_work_reason(self, params: Mapping[str, Any]) -> str:
        """Why finalize finds no parts: no worker ran, or workers ran with other settings
        (their run key, hence their work directory, differs); say which setting."""
        others = sorted(self.out.parent.glob(f"{self.out.name}.tmp-shared-*"))
        for other in others:
            try:
                theirs = json.loads((other / RUN_RECORD).read_bytes())
            except (OSError, ValueError):
                continue
            differ = [k for k in params if theirs.get(k) != params[k]]
            if differ:
                said = "; ".join(
                    f"{k} {theirs.get(k)} (this finalize: {params[k]})" for k in differ
                )
                hint = (
                    f" (--max-part-bytes {theirs['maxPartBytes']})"
                    if "maxPartBytes" in differ
                    else ""
                )
                return (
                    f"{self.out}: the workers' parts in {other} were written with other "
                    f"settings: {said}; run finalize with the workers' arguments{hint}"
                )
        if others:
            return (
                f"{self.out}: no parts of this run, but parts of another run are in "
                f"{others[0]}: the workers ran with other settings (--max-part-bytes, stager "
                "version or source); run finalize with the workers' exact arguments"
            )
        return (
            f"{self.work}: no worker has written this artifact; run the "
            "`modelstage stage --group i/n` workers first"
        )

    def completed(self, name: str, size: int) -> FileDigest | None:
        """A part a worker of this run finished: renamed into place with its sidecar. Its
        bytes are checked by ``check_part`` at finalize (a worker's rerun only skips it)."""
        if self.work is None or not self.shared:
            return None
        path = self.work / name
        try:
            with open(sidecar_path(path), "rb") as f:
                record = json.loads(f.read(SIDECAR_MAX_BYTES))
            on_disk = os.stat(path).st_size
        except (FileNotFoundError, ValueError, RecursionError):
            return None
        if not isinstance(record, dict):
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
                with contextlib.suppress(OSError):
                    remove_leftover(stale)
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
        self._lock.release()
