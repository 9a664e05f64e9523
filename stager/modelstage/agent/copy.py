"""``modelstage node-copy``: one artifact from the PVC or S3 into the node-local root.

The copy is made in ``.partial/<digest>`` under the digest's lock, every chunk checked
against the source manifest's hash: from a local source (a mounted PVC) the kernel copies each
file and the copy is verified where it landed, a few files at a time (``_copy_local_files``);
from S3 each file is read in chunks (ranged GETs, a few in flight), each chunk checked before
its bytes are written. Each file is fsynced, the manifest (the source's bytes, unchanged)
written last, then the directory renamed to ``<digest>``: a directory named by a digest is
always complete and verified. A copy that stops (killed, a node reboot) leaves
its partial directory; the next run keeps every file there whose size is right and whose
chunks verify, and rewrites the rest. A complete copy whose manifest equals the source's makes
the command a no-op. Paths are built only from a checked digest and the manifest's file names,
which the manifest parser allows only as plain names: nothing outside the root is written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelstage.core import node_cache
from modelstage.core.errors import ArtifactError
from modelstage.core.integrity import (
    DEFAULT_CHUNK_BYTES,
    ChunkMismatch,
    FileDigest,
    blake3_module,
    chunk_count,
    chunk_range,
    hash_local_files,
)
from modelstage.core.location import (
    ArtifactLocation,
    Listed,
    LocalArtifact,
    check_files,
    open_artifact,
)
from modelstage.core.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    check_ranks_present,
)

from .locks import digest_lock, fsync_dir, own_dir, write_atomic

if TYPE_CHECKING:
    from modelstage.core.s3_client import S3Options

READ_AHEAD = 4
"""Chunks read ahead of the one being checked and written (S3: GETs in flight)."""
LOCAL_COPIES = 4
"""Files of a local source copied at once (``_copy_local_files``)."""


@dataclass
class CopyResult:
    digest: str
    bytes: int
    files: int
    seconds: float
    copied_bytes: int
    resumed_files: int
    root: Path
    already_complete: bool = False

    def summary(self) -> dict[str, Any]:
        """The CLI's one-line JSON summary; the rate is of the bytes copied by this run."""
        rate = self.copied_bytes / self.seconds if self.seconds > 0 else 0.0
        return {
            "digest": self.digest,
            "bytes": self.bytes,
            "files": self.files,
            "seconds": round(self.seconds, 3),
            "bytesPerSecond": round(rate, 1),
            "resumedFiles": self.resumed_files,
            "alreadyComplete": self.already_complete,
            "root": str(self.root),
        }


def node_copy(
    artifact: str,
    *,
    digest: str,
    root: Path,
    tp: int | None = None,
    s3: S3Options | None = None,
) -> CopyResult:
    """Copy the artifact at ``artifact`` (a directory or ``s3://BUCKET/PREFIX/``) to
    ``root/<digest>``, verified; a no-op when that copy is already complete."""
    node_cache.check_digest(digest)
    started = time.monotonic()
    source = open_artifact(artifact, s3)
    raw = _raw_manifest(source)
    manifest = Manifest.from_json(raw, source.where(MANIFEST))
    manifest.check_expected(source.uri, digest=digest, tp=tp)
    check_ranks_present(source.uri, manifest)
    root.mkdir(parents=True, exist_ok=True)
    own_dir(root / node_cache.PARTIAL)
    own_dir(root / node_cache.STATE)
    with digest_lock(node_cache.lock_file(root, digest)):
        final = node_cache.copy_dir(root, digest)
        if _complete(final, raw):
            return CopyResult(digest, manifest.bytes, len(manifest.files), 0.0, 0, 0, root, True)
        _clear_broken(final)
        listing = source.listing()
        check_files(source, manifest, sorted(manifest.files), listing)
        partial = own_dir(node_cache.partial_dir(root, digest))
        _remove_strays(partial, manifest)
        todo = [n for n in sorted(manifest.files)
                if not _resumable(_inside(partial, n), manifest.files[n])]  # fmt: skip
        resumed = len(manifest.files) - len(todo)
        local = [n for n in todo if isinstance(source, LocalArtifact)
                 and manifest.files[n].digest is not None]  # fmt: skip
        _copy_local_files(source, local, manifest, partial)
        for name in todo:
            if name not in local:
                _copy_file(
                    source, name, manifest.files[name], listing[name], _inside(partial, name)
                )
        copied = sum(manifest.files[n].size for n in todo)
        write_atomic(partial / MANIFEST, raw)
        fsync_dir(partial)
        os.rename(partial, final)
        fsync_dir(partial.parent)
        fsync_dir(root)
        seconds = time.monotonic() - started
        _write_state(root, digest, manifest, seconds, artifact)
    return CopyResult(digest, manifest.bytes, len(manifest.files), seconds, copied, resumed, root)


def _raw_manifest(source: ArtifactLocation) -> bytes:
    """The source's manifest bytes, as they are (the copy's manifest is byte-identical)."""
    try:
        raw = source.manifest_bytes()
    except OSError as e:
        raise ArtifactError(f"{source.where(MANIFEST)}: cannot read: {e.strerror}") from None
    if raw is None:
        raise ArtifactError(f"{source.uri}: no {MANIFEST}; the artifact is incomplete")
    return raw


def _complete(final: Path, raw: bytes) -> bool:
    try:
        return (final / MANIFEST).read_bytes() == raw
    except (FileNotFoundError, NotADirectoryError):
        return False


def _clear_broken(final: Path) -> None:
    """A ``<digest>`` entry that is not this artifact's complete copy (a removal that
    stopped half-way, or a manifest that differs): removed before the copy replaces it."""
    if final.is_symlink() or final.is_file():
        final.unlink()
    elif final.exists():
        (final / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(final)


def _inside(directory: Path, name: str) -> Path:
    """``directory/name``, refused unless it is a plain child (the manifest parser already
    allows only plain names; this is the last line)."""
    target = directory / name
    if target.parent != directory or name in ("", ".", "..") or "/" in name:
        raise ArtifactError(f"{name!r} is not a plain file name; refusing to write it")
    return target


def _remove_strays(partial: Path, manifest: Manifest) -> None:
    """Files of the partial copy that the manifest does not list (another attempt's temp
    files, a manifest written before a crash): the manifest must come last."""
    for entry in os.scandir(partial):
        if entry.name in manifest.files and entry.is_file(follow_symlinks=False):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def _resumable(target: Path, entry: FileEntry) -> bool:
    """A file a stopped copy left: kept when its size is right and every chunk verifies."""
    try:
        stat = os.stat(target, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.st_size != entry.size:
        return False
    try:
        if entry.digest is not None:
            hash_local_files([target], [entry.digest])
        else:
            with open(target, "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != entry.sha256:
                    return False
    except ArtifactError:
        return False
    return True


def _copy_local_files(
    source: ArtifactLocation, names: list[str], manifest: Manifest, partial: Path
) -> None:
    """``_copy_local_file`` for each of ``names``, ``LOCAL_COPIES`` at a time: one file's
    kernel copy, another's hashing and a third's ``fsync`` overlap (the first failure is
    raised once the files in flight have ended, each removing what it wrote)."""
    if not names:
        return
    assert isinstance(source, LocalArtifact)
    with ThreadPoolExecutor(LOCAL_COPIES, thread_name_prefix="modelstage-copy") as pool:
        futures = [
            pool.submit(
                _copy_local_file, source, n, _digest_of(manifest.files[n]), _inside(partial, n)
            )
            for n in names
        ]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()


def _digest_of(entry: FileEntry) -> FileDigest:
    assert entry.digest is not None
    return entry.digest


def _copy_local_file(source: LocalArtifact, name: str, want: FileDigest, target: Path) -> None:
    """A local source: the kernel copies the bytes (``copy_file_range``, else ``sendfile``:
    they never pass through this process), then the copy is verified where it landed, every
    chunk against the manifest on the hashing threads, so what is checked is the node's bytes
    themselves, read back from the page cache the copy just filled."""
    where = source.where(name)
    with _new_file(target) as fd:
        try:
            src = os.open(source.directory / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise ArtifactError(f"{where}: cannot read: {e.strerror}") from None
        try:
            _kernel_copy(src, fd, want.size)
        finally:
            os.close(src)
        try:
            hash_local_files([target], [want])
        except ChunkMismatch as e:
            raise _mismatch(where, e) from None
        os.fsync(fd)


@contextlib.contextmanager
def _new_file(target: Path) -> Iterator[int]:
    """``target`` created (never through a link) for writing; removed if the block fails, so
    that nothing unverified stays in the partial copy."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        yield fd
    except BaseException:
        os.close(fd)
        fd = -1
        target.unlink(missing_ok=True)
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def _kernel_copy(src: int, dst: int, size: int) -> None:
    """``size`` bytes from ``src`` to ``dst`` inside the kernel; a source that ends early
    is refused (the verification would refuse it anyway, less clearly)."""
    done = 0
    copy: Callable[[int, int, int], int] = _copy_file_range
    while done < size:
        try:
            n = copy(src, dst, size - done)
        except OSError as e:
            if copy is _copy_file_range and e.errno in _NO_COPY_FILE_RANGE:
                copy = _sendfile  # another filesystem, or a kernel without it
                continue
            raise
        if n == 0:
            raise ArtifactError(f"the source file ended after {done} of {size} bytes")
        done += n


def _copy_file_range(src: int, dst: int, count: int) -> int:
    return os.copy_file_range(src, dst, min(count, _KERNEL_COPY_BYTES))


def _sendfile(src: int, dst: int, count: int) -> int:
    return os.sendfile(dst, src, None, min(count, _KERNEL_COPY_BYTES))


_KERNEL_COPY_BYTES = 1 << 30
_NO_COPY_FILE_RANGE = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


def _copy_file(
    source: ArtifactLocation, name: str, entry: FileEntry, listed: Listed, target: Path
) -> None:
    """Read, check, write: a chunk is written only once its hash matched the manifest's."""
    where = source.where(name)
    want = entry.digest
    chunk_bytes = want.chunk_bytes if want is not None else DEFAULT_CHUNK_BYTES
    sha256 = hashlib.sha256() if want is None else None
    new_hash = blake3_module().blake3
    with _new_file(target) as fd:
        with source.reader(name, listed) as read_into:
            for index, data in _chunks(read_into, entry.size, chunk_bytes, source.workers):
                if want is not None:
                    actual = new_hash(data).hexdigest()
                    if actual != want.chunks[index]:
                        raise _mismatch(where, ChunkMismatch(where, want, index, actual))
                elif sha256 is not None:
                    sha256.update(data)
                _write_all(fd, data)
        if sha256 is not None and sha256.hexdigest() != entry.sha256:
            raise ArtifactError(
                f"{where}: sha256 {sha256.hexdigest()}, expected {entry.sha256}; "
                "the source is corrupt"
            )
        os.fsync(fd)


def _mismatch(where: str, error: ChunkMismatch) -> ArtifactError:
    return ArtifactError(
        f"{where}: chunk {error.index} (bytes {error.begin}-{error.end - 1}): "
        f"expected {error.expected}, got {error.actual}"
    )


def _chunks(
    read_into: Callable[[int, memoryview], None], size: int, chunk_bytes: int, workers: int
) -> Iterator[tuple[int, bytearray]]:
    """The file's chunks in order, ``READ_AHEAD`` (at least ``workers``) reads in flight:
    bounded memory, whatever the file's size."""

    def read(index: int) -> bytearray:
        lo, hi = chunk_range(size, chunk_bytes, index)
        buf = bytearray(hi - lo)
        read_into(lo, memoryview(buf))
        return buf

    count = chunk_count(size, chunk_bytes)
    ahead = max(READ_AHEAD, workers)
    with ThreadPoolExecutor(ahead, thread_name_prefix="modelstage-copy") as pool:
        pending: list[Future[bytearray]] = []
        try:
            for index in range(count):
                pending.append(pool.submit(read, index))
                if len(pending) > ahead:
                    yield index - ahead, pending.pop(0).result()
            first = count - len(pending)
            for offset, future in enumerate(pending):
                yield first + offset, future.result()
        finally:
            for future in pending:
                future.cancel()


def _write_all(fd: int, data: bytearray) -> None:
    view = memoryview(data)
    while len(view):
        view = view[os.write(fd, view) :]


def _write_state(root: Path, digest: str, manifest: Manifest, seconds: float, source: str) -> None:
    now = datetime.now(UTC).isoformat()
    record = {
        "digest": digest,
        "bytes": manifest.bytes,
        "files": len(manifest.files),
        "copiedAt": now,
        "copySeconds": round(seconds, 3),
        "source": source,
        "lastUsed": now,
    }
    write_atomic(node_cache.state_file(root, digest), json.dumps(record).encode())
