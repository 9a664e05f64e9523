"""Chunked content hashes: every byte of an artifact checked by whoever reads it, as it lands.

A file is cut into fixed-size chunks from offset 0 (the last one shorter; an empty file has
none), and each chunk has its own BLAKE3 hash. A reader that fetches chunks in any order or in
parallel (``preadv`` workers, S3 ranged GETs) checks each one the moment its bytes are in, and
a mismatch names the file, the chunk, its byte range and both hashes. The file's own hash (the
*root*) is BLAKE3, in its key-derivation mode with a context string of its own, over the file
size, the chunk size and the chunk hashes: one value that pins every byte (S3 metadata, the
scale-out sidecars), recomputed from the chunks without a second pass.

Why BLAKE3: it is cryptographic (a corrupted or substituted file cannot be made to match) and
about 4x sha256's speed per core here (SIMD), so hashing every byte no longer bounds staging
or loading on a small node; the ``blake3`` package (the reference Rust implementation) releases
the GIL while it hashes, so worker threads hash in parallel, and every vLLM image has it (vLLM
depends on it). Non-cryptographic checksums (xxh3, crc32c) are faster still but would not
catch a file replaced on purpose.

Torch-free, and imports nothing of the stager's writers: the stager, ``verify``, ``prepare``,
the S3 destination and the loader plugin share this one code path.
"""

from __future__ import annotations

import collections
import errno
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ArtifactError

if TYPE_CHECKING:
    from .progress import Progress

MiB = 1024 * 1024
DEFAULT_CHUNK_BYTES = 32 * MiB
"""32 MiB: the S3 reader's GET size (a chunk is fetched, and checked, by one GET) and two of
the local reader's reads; a 140 GB artifact lists about 4,200 chunks (some 300 KB of JSON)."""
MAX_CHUNKS_PER_FILE = 1_000_000
MAX_CHUNK_BYTES = 64 * MiB
"""The largest chunk a manifest may declare: every reader holds a few chunks in memory at
once, so a manifest's ``chunkBytes`` bounds a reader's memory (a 2 GiB chunk would be an OOM
kill in a pod, not an error)."""
ROOT_CONTEXT = "modelstage.io 2025 chunked-file root v1"
"""BLAKE3 key-derivation context of the root: a root can never equal any chunk's hash or any
plain BLAKE3 of the same bytes."""
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that hash what the loader's reads brought in, beside the read threads: a read
thread is free for the next read as soon as its bytes are in."""
VERIFY_WORKERS = 1
"""Reads in flight in ``hash_files`` on a local disk: one sequential reader, which the
kernel's readahead follows, with the hashing on threads of its own (``docs/performance.md``)."""

Bytes = bytes | bytearray | memoryview
ReadInto = Callable[[int, memoryview], None]
"""``read_into(offset, view)``: fill ``view`` with the file's bytes from ``offset``."""


def blake3_module() -> Any:
    """The ``blake3`` package, or a refusal that says what to install (never a silent skip)."""
    try:
        import blake3
    except ImportError:
        raise ArtifactError(
            "the blake3 package is not installed: it is needed to verify artifact content "
            "(`pip install blake3`; vLLM images have it)"
        ) from None
    return blake3


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def chunk_range(size: int, chunk_bytes: int, index: int) -> tuple[int, int]:
    """``[begin, end)`` of chunk ``index``."""
    begin = index * chunk_bytes
    return begin, min(begin + chunk_bytes, size)


def root_hash(size: int, chunk_bytes: int, chunks: Sequence[str]) -> str:
    h = blake3_module().blake3(derive_key_context=ROOT_CONTEXT)
    h.update(struct.pack("<QQ", size, chunk_bytes))
    for chunk in chunks:
        h.update(bytes.fromhex(chunk))
    return str(h.hexdigest())


@dataclass(frozen=True)
class FileDigest:
    """A file's size and chunk hashes: what the manifest records and every reader checks."""

    size: int
    chunk_bytes: int
    chunks: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk size must be positive, not {self.chunk_bytes}")
        if self.chunk_bytes > MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk size {self.chunk_bytes} is more than {MAX_CHUNK_BYTES} bytes (64 MiB)"
            )
        if len(self.chunks) != chunk_count(self.size, self.chunk_bytes):
            raise ValueError(
                f"{len(self.chunks)} chunk hashes for {self.size} bytes in chunks of "
                f"{self.chunk_bytes}; expected {chunk_count(self.size, self.chunk_bytes)}"
            )

    @property
    def root(self) -> str:
        return root_hash(self.size, self.chunk_bytes, self.chunks)

    def range(self, index: int) -> tuple[int, int]:
        return chunk_range(self.size, self.chunk_bytes, index)


class ChunkMismatch(ArtifactError):
    """A chunk whose bytes do not hash to what the manifest says; names where and what."""

    def __init__(
        self,
        where: str,
        digest: FileDigest,
        index: int,
        actual: str,
        *,
        recorded: str = "the manifest",
        advice: str = "re-stage it",
    ) -> None:
        self.where, self.index, self.actual, self.recorded = where, index, actual, recorded
        self.expected = digest.chunks[index]
        self.begin, self.end = digest.range(index)
        super().__init__(f"{where}: {self.reason}: {advice}")

    @property
    def reason(self) -> str:
        """What differs, without the file's name."""
        return (
            f"chunk {self.index} (bytes {self.begin}-{self.end - 1}) has BLAKE3 "
            f"{self.actual}, {self.recorded} says {self.expected}; the file is corrupt"
        )


class ChunkedHasher:
    """Hashes a file written front to back, chunk by chunk, from bytes the writer already
    holds (its own copy, still in the CPU's cache). Not thread-safe: one writer."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk size must be positive, not {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._blake3 = blake3_module().blake3
        self._current = self._blake3()
        self._fill = 0
        self._size = 0
        self._chunks: list[str] = []

    def update(self, data: Bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = min(len(view), self.chunk_bytes - self._fill)
            self._current.update(view[:n])
            self._fill += n
            self._size += n
            view = view[n:]
            if self._fill == self.chunk_bytes:
                self._chunks.append(self._current.hexdigest())
                self._current, self._fill = self._blake3(), 0

    def finish(self) -> FileDigest:
        if self._fill:
            self._chunks.append(self._current.hexdigest())
            self._current, self._fill = self._blake3(), 0
        return FileDigest(self._size, self.chunk_bytes, tuple(self._chunks))


def digest_bytes(data: Bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> FileDigest:
    hasher = ChunkedHasher(chunk_bytes)
    hasher.update(data)
    return hasher.finish()


@dataclass
class HashStats:
    """What checking cost: bytes hashed, and the seconds spent hashing summed over threads
    (they overlap the reads: compare with the wall time)."""

    bytes: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes += nbytes
            self.seconds += seconds


class ChunkChecker:
    """Checks chunks of several files as they land, in any order and from any thread.

    ``check(file, begin, views)``: ``views`` hold the file's bytes ``[begin, begin + n)`` in
    order, where ``begin`` is a chunk boundary and ``begin + n`` one too (or the file's end):
    one or more whole chunks, each hashed and compared on its own. Raises ``ChunkMismatch``.
    """

    def __init__(self, files: Sequence[tuple[str, FileDigest]]) -> None:
        self.files = list(files)
        self.stats = HashStats()

    def read_bytes(self, wanted: int) -> int:
        """A buffered reader's read size: ``wanted``, or the largest chunk when that is
        larger (a buffer must hold whole chunks: it is reused once they are checked)."""
        return max([wanted, *(d.chunk_bytes for _, d in self.files)])

    def check(self, file: int, begin: int, views: Sequence[memoryview]) -> None:
        stream = self.stream(file, begin)
        for view in views:
            stream.update(view)
        stream.close()

    def stream(self, file: int, begin: int) -> ChunkStream:
        """Check ``file``'s bytes from ``begin`` (a chunk boundary) on, fed in order by one
        thread as they land, so each piece is hashed while it is still in the CPU's cache."""
        return ChunkStream(self, file, begin)


class ChunkStream:
    """A file's bytes from a chunk boundary on, fed in order; each chunk is compared the
    moment its last byte is in (``ChunkMismatch``), ``close`` checks that the bytes ended on a
    chunk boundary or at the end of the file. One thread."""

    def __init__(self, checker: ChunkChecker, file: int, begin: int) -> None:
        self.checker = checker
        self.where, self.digest = checker.files[file]
        if begin % self.digest.chunk_bytes:
            raise ValueError(f"{self.where}: a check must start on a chunk boundary, not {begin}")
        self.index = begin // self.digest.chunk_bytes
        self.fill, self.total, self.seconds = 0, 0, 0.0
        self._blake3 = blake3_module().blake3
        self.hasher = self._blake3()

    def update(self, view: memoryview) -> None:
        started = time.perf_counter()
        while len(view):
            if self.index >= len(self.digest.chunks):
                raise ValueError(f"{self.where}: bytes beyond the end at {self.digest.size}")
            lo, hi = self.digest.range(self.index)
            n = min(len(view), hi - lo - self.fill)
            self.hasher.update(view[:n])
            self.fill += n
            view = view[n:]
            if self.fill == hi - lo:
                actual = self.hasher.hexdigest()
                if actual != self.digest.chunks[self.index]:
                    raise ChunkMismatch(self.where, self.digest, self.index, actual)
                self.total += hi - lo
                self.index, self.fill, self.hasher = self.index + 1, 0, self._blake3()
        self.seconds += time.perf_counter() - started

    def close(self) -> None:
        if self.fill:
            lo, hi = self.digest.range(self.index)
            raise ValueError(
                f"{self.where}: chunk {self.index} given {self.fill} of {hi - lo} bytes"
            )
        self.checker.stats.add(self.total, self.seconds)


@dataclass(frozen=True)
class FileToHash:
    """One file for ``hash_files``: where (for messages), its size, how to read it, and what
    it must hash to (``expected``: its digest, or only its ``root``), if known."""

    where: str
    size: int
    read_into: ReadInto
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    expected: FileDigest | None = None
    expected_root: str | None = None
    recorded: str = "the manifest"
    """Who recorded ``expected``, for the message."""


def hash_files(
    files: Sequence[FileToHash],
    *,
    workers: int = VERIFY_WORKERS,
    progress: Progress | None = None,
) -> tuple[list[FileDigest], HashStats]:
    """Read and hash every chunk of ``files``, in file order: ``workers`` reads in flight,
    each handing its chunk to the hashing threads (``HASH_THREADS``) and going on to the next
    read; stops at the first mismatch (``ChunkMismatch`` against ``expected``; a root that
    differs from ``expected_root`` names the file). One reader suits a local disk (its
    readahead follows one sequential reader), several suit S3 (one GET per chunk). Memory:
    ``workers + HASH_THREADS`` chunk buffers."""
    for f in files:
        if f.expected is not None and f.expected.size != f.size:
            raise ArtifactError(f"{f.where}: {f.size} bytes, the manifest says {f.expected.size}")
        if f.expected is not None and f.expected.chunk_bytes != f.chunk_bytes:
            raise ValueError(
                f"{f.where}: read in chunks of {f.chunk_bytes}, hashed in {f.expected.chunk_bytes}"
            )
    run = _HashRun(files, progress)
    run.run(max(1, workers), HASH_THREADS)
    results = zip(files, run.results, strict=True)
    digests = [FileDigest(f.size, f.chunk_bytes, tuple(r)) for f, r in results]
    for f, d in zip(files, digests, strict=True):
        if f.expected_root is not None and d.root != f.expected_root:
            raise ArtifactError(
                f"{f.where}: content hash {d.root} differs from the recorded {f.expected_root}; "
                f"the file or {f.recorded} is corrupt"
            )
    return digests, run.stats


_Read = Future[Future[None] | None]
"""A read in flight; its result is the hashing of what it read (None: it did not read)."""


class _HashRun:
    """One ``hash_files`` call: reader threads fill reused buffers, hashing threads check
    them; a buffer goes back once its chunk is hashed."""

    def __init__(self, files: Sequence[FileToHash], progress: Progress | None) -> None:
        self.files, self.progress = files, progress
        self.jobs = [
            (i, c) for i, f in enumerate(files) for c in range(chunk_count(f.size, f.chunk_bytes))
        ]
        self.results: list[list[str]] = [[""] * chunk_count(f.size, f.chunk_bytes) for f in files]
        self.remaining = [len(r) for r in self.results]
        self.counted = threading.Lock()
        self.stats = HashStats()
        self.failed = threading.Event()
        self.new = blake3_module().blake3
        self.free: list[memoryview] = []
        self.hashers: ThreadPoolExecutor | None = None

    def run(self, readers: int, hashing: int) -> None:
        largest = max((f.chunk_bytes for f in self.files), default=0)
        buffers = min(len(self.jobs), readers + hashing)
        self.free = [memoryview(bytearray(largest)) for _ in range(buffers)]
        with (
            ThreadPoolExecutor(readers, thread_name_prefix="modelstage-read") as pool,
            ThreadPoolExecutor(hashing, thread_name_prefix="modelstage-hash") as self.hashers,
        ):
            pending: collections.deque[tuple[_Read, memoryview]] = collections.deque()
            try:
                for i, index in self.jobs:
                    if not self.free:
                        self._wait(*pending.popleft())
                    buf = self.free.pop()
                    pending.append((pool.submit(self._read, i, index, buf), buf))
                while pending:
                    self._wait(*pending.popleft())
            except BaseException:
                self.failed.set()  # reads still queued return at once; the pools wait
                raise
        if self.progress is not None:  # empty files have no chunk to report them
            for _ in (r for r in self.results if not r):
                self.progress.tensor_done()

    def _read(self, i: int, index: int, buf: memoryview) -> Future[None] | None:
        if self.failed.is_set():
            return None
        f = self.files[i]
        lo, hi = chunk_range(f.size, f.chunk_bytes, index)
        view = buf[: hi - lo]
        try:
            f.read_into(lo, view)
        except BaseException:
            self.failed.set()
            raise
        assert self.hashers is not None
        return self.hashers.submit(self._hash, i, index, view)

    def _hash(self, i: int, index: int, view: memoryview) -> None:
        f = self.files[i]
        started = time.perf_counter()
        actual = self.new(view).hexdigest()
        self.stats.add(len(view), time.perf_counter() - started)
        if f.expected is not None and actual != f.expected.chunks[index]:
            self.failed.set()
            raise ChunkMismatch(f.where, f.expected, index, actual, recorded=f.recorded)
        self.results[i][index] = actual
        if self.progress is not None:
            self.progress.advance(len(view))
            with self.counted:
                self.remaining[i] -= 1
                whole = self.remaining[i] == 0
            if whole:
                self.progress.tensor_done()

    def _wait(self, read: _Read, buf: memoryview) -> None:
        hashed = read.result()
        if hashed is not None:
            hashed.result()
        self.free.append(buf)


def open_regular(path: Path | str, *, follow: bool = False, dir_fd: int | None = None) -> int:
    """A read-only descriptor of ``path``, refused (``OSError``) unless it is a regular file:
    a FIFO or a device is never waited on (``O_NONBLOCK``), a link is not followed unless
    ``follow`` (a link at the last component fails with ``ELOOP``). What a hostile writer
    may have put in a directory (the node cache's root) is opened only through this;
    ``dir_fd``: ``path`` is relative to that open directory."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LocalFile:
    """A local file opened for ``hash_files`` (``with LocalFile(path) as f: f.read_into``)."""

    def __init__(self, path: Path, *, follow: bool = True) -> None:
        self.path = path
        self.fd = -1
        self.follow = follow

    def __enter__(self) -> LocalFile:
        self.fd = open_regular(self.path, follow=self.follow)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_into(self, offset: int, view: memoryview) -> None:
        while len(view):
            n = os.preadv(self.fd, [view], offset)
            if n == 0:
                raise ArtifactError(f"{self.path}: ends at byte {offset}, shorter than expected")
            view, offset = view[n:], offset + n


def hash_local_files(
    paths: Sequence[Path],
    expected: Sequence[FileDigest | None] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int = VERIFY_WORKERS,
    recorded: str = "the manifest",
    progress: Progress | None = None,
) -> list[FileDigest]:
    """``hash_files`` over local files (sizes from ``stat``; the chunk size from ``expected``
    where given)."""
    wanted = list(expected) if expected is not None else [None] * len(paths)
    opened = [LocalFile(p) for p in paths]
    try:
        jobs = []
        for f, want in zip(opened, wanted, strict=True):
            f.__enter__()
            size = os.fstat(f.fd).st_size
            jobs.append(
                FileToHash(
                    str(f.path),
                    size,
                    f.read_into,
                    want.chunk_bytes if want else chunk_bytes,
                    want,
                    recorded=recorded,
                )
            )
        return hash_files(jobs, workers=workers, progress=progress)[0]
    finally:
        for f in opened:
            f.__exit__()
