"""The pipelined reader: a rank's safetensors files -> parameter memory, at the disk's pace.

vLLM's stock sharded-state path (``safe_open`` + ``get_tensor`` + ``param.copy_``) reads one
tensor at a time, materialises it in a fresh host tensor, then copies it; reads and copies
alternate and nothing overlaps. Here the data section of each file is read front to back in
fixed-size chunks, ``depth`` reads in flight on a thread pool (a store's ``preadv`` or ranged
GET, ``stores.py``; both release the GIL) into a small pool of reused buffers — pinned where
CUDA exists, so host-to-device copies are asynchronous on a copy stream and overlap the next
reads. Each chunk is copied straight into the byte ranges of the parameters it covers, so no
tensor and no file is ever materialised; memory is ``(depth + 2) * chunk`` whatever the model's
size. Where the parameters live in host memory (vLLM on CPU) there is nothing to overlap and a
bounce buffer would only add a copy, so reads land directly in the parameters (``direct``
mode). A parameter that cannot take raw bytes (another dtype, a narrower shape, not contiguous)
gets a host staging tensor of its own size and vLLM's ``copy_`` semantics once complete.

Headers come from the verify phase (``checks.py``), so the reader never parses JSON and knows
every tensor's byte range before the first read.

Verification while streaming: given a ``ChunkChecker`` (``integrity.py``), the reader reads
every byte of every file, from offset 0 to the end (the header and any hole between tensors
too, into a scratch buffer), in reads that each hold whole hash chunks of the manifest. Each
read, once in, is handed to a small pool of hashing threads, so the read thread goes straight
on to the next read: the hash overlaps the reads and the copies (BLAKE3 releases the GIL). A
chunk is checked as soon as it lands, in whatever order reads complete, always before the
tensors it covers are finished or copied to the device, and a mismatch fails the load naming
the file, the chunk and both hashes.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from modelstage.core.integrity import HASH_THREADS, ChunkChecker
from modelstage.core.safetensors_format import SafetensorsHeader, TensorInfo

from .stores import LocalFiles, RankBytes

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SPARE_BUFFERS = 2
"""Buffers beyond ``depth``: chunks whose copies are still in flight on the copy stream."""


@dataclass(frozen=True)
class Target:
    """Where one tensor's bytes go: ``flat`` is a contiguous 1-D uint8 tensor of exactly the
    tensor's size (a view of the parameter, or a staging tensor); ``finish`` runs once all
    bytes are in."""

    flat: torch.Tensor
    finish: Callable[[], None] | None = None


TargetFor = Callable[[TensorInfo], Target]


@dataclass
class ReadStats:
    bytes: int = 0
    files: int = 0
    read_seconds: float = 0.0
    """Wall time from the first read's start to the last read's end."""
    copy_seconds: float = 0.0
    """Time spent copying into parameters: device time of the copies on CUDA, the copies'
    wall time on CPU. Overlaps ``read_seconds``; the two do not add up to the total."""
    wait_seconds: float = 0.0
    """Time the copier sat waiting for a read: near zero means copy-bound, near the total
    means read-bound."""
    _spans: list[tuple[float, float]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _read_done(self, start: float, end: float, nbytes: int) -> None:
        with self._lock:
            self._spans.append((start, end))
            self.bytes += nbytes

    def _close(self) -> None:
        if self._spans:
            self.read_seconds = max(e for _, e in self._spans) - min(s for s, _ in self._spans)


@dataclass(frozen=True)
class _Chunk:
    file: int
    """Index of the file in the store."""
    begin: int
    end: int
    tensors: tuple[TensorInfo, ...]
    """The tensors with at least one byte in ``[begin, end)``, in file order."""


def chunks(
    headers: Sequence[SafetensorsHeader],
    chunk_bytes: int,
    whole: Sequence[tuple[int, int]] | None = None,
) -> Iterator[_Chunk]:
    """Cut every file's data section into chunks of at most ``chunk_bytes``; pure.

    ``whole``: per file its (size, hash chunk size): cut the whole file, from offset 0, so
    that every byte is read and no read crosses a hash chunk's boundary: reads of as many
    whole hash chunks as fit in ``chunk_bytes``, or, when a hash chunk is larger, each hash
    chunk in reads of ``chunk_bytes`` (what verifying needs)."""
    for file, header in enumerate(headers):
        tensors = sorted((t for t in header.tensors.values() if t.nbytes), key=lambda t: t.begin)
        if whole is not None:
            spans = _whole_reads(whole[file][0], whole[file][1], chunk_bytes)
        elif not tensors:
            continue
        else:
            start, stop = tensors[0].begin, max(t.end for t in tensors)
            spans = ((b, min(b + chunk_bytes, stop)) for b in range(start, stop, chunk_bytes))
        first = 0
        for begin, end in spans:
            while first < len(tensors) and tensors[first].end <= begin:
                first += 1
            last = first
            while last < len(tensors) and tensors[last].begin < end:
                last += 1
            yield _Chunk(file, begin, end, tuple(tensors[first:last]))


def _whole_reads(size: int, hash_chunk: int, read_bytes: int) -> Iterator[tuple[int, int]]:
    if read_bytes >= hash_chunk:
        step = read_bytes // hash_chunk * hash_chunk
        yield from ((b, min(b + step, size)) for b in range(0, size, step))
        return
    for c in range(0, size, hash_chunk):
        stop = min(c + hash_chunk, size)
        yield from ((b, min(b + read_bytes, stop)) for b in range(c, stop, read_bytes))


class PipelinedReader:
    """Reads rank files into targets; one instance per load (it owns the buffers).

    Two modes. ``buffered`` (the default for CUDA): chunks through pinned buffers and async
    copies, as described above. ``direct`` (the default for host targets, i.e. vLLM on CPU):
    each tensor's byte range is read straight into its target's memory, ``depth`` reads in
    flight and no buffer at all — on a host, a bounce buffer would only add a copy (measured
    here: ``preadv`` 5 GB/s, ``preadv`` + ``copy_`` 1.8 GB/s, and worse once torch's OMP
    threads compete with the reader threads for the cores).
    """

    def __init__(
        self, *, chunk_bytes: int, depth: int, device: torch.device, direct: bool | None = None
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self.cuda = device.type == "cuda"
        self.direct = not self.cuda if direct is None else direct
        if self.direct and self.cuda:
            raise ValueError("direct reads need host targets; CUDA targets need buffers")
        stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.stream: torch.cuda.Stream | None = stream
        self.buffers = (
            []
            if self.direct
            else [
                torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self.cuda)
                for _ in range(depth + SPARE_BUFFERS)
            ]
        )

    def read(
        self,
        files: RankBytes | Sequence[tuple[Path, SafetensorsHeader]],
        target_for: TargetFor,
        checker: ChunkChecker | None = None,
    ) -> ReadStats:
        """Read every tensor of ``files`` (a store, or local files with their headers); with
        ``checker`` (its files in the store's order), every byte of every file, each hash
        chunk checked as it lands (``ChunkMismatch`` otherwise)."""
        store = files if isinstance(files, RankBytes) else LocalFiles(files)
        stats = ReadStats(files=len(store.headers))
        whole = None
        if checker is not None:
            if len(checker.files) != len(store.headers):
                raise ValueError("the checker must list the store's files, in order")
            whole = [(d.size, d.chunk_bytes) for _, d in checker.files]
            if not self.direct and any(c > self.chunk_bytes for _, c in whole):
                raise ValueError(
                    f"buffers of {self.chunk_bytes} bytes cannot hold a whole hash chunk; "
                    "size the reader with ChunkChecker.read_bytes"
                )
        with store:
            for header in store.headers:  # zero-byte tensors get no chunk; finish them now
                for info in header.tensors.values():
                    if not info.nbytes:
                        _finish(target_for(info))
            work = chunks(store.headers, self.chunk_bytes, whole)
            if self.direct:
                self._direct(store, work, target_for, stats, checker)
            else:
                self._pipeline(store, work, target_for, stats, checker)
        stats._close()
        return stats

    def _direct(
        self,
        store: RankBytes,
        work: Iterator[_Chunk],
        target_for: TargetFor,
        stats: ReadStats,
        checker: ChunkChecker | None,
    ) -> None:
        """Read every chunk of the files with one vectored read straight into the targets'
        memory (``preadv``: one iovec per tensor piece), ``depth`` reads in flight; a target
        is finished once the chunk holding its last byte is in (chunks complete in order,
        and targets are created in file order, so staging memory stays a few chunks)."""
        pending: collections.deque[tuple[Future[Hashed], list[Target], _HashGroup | None]] = (
            collections.deque()
        )
        open_targets: dict[str, tuple[Target, memoryview]] = {}
        pool = ThreadPoolExecutor(self.depth, thread_name_prefix="modelstage-read")
        hashers = _hash_pool(checker)
        group: _HashGroup | None = None

        held: list[Target] = []
        """Targets complete but not yet checked: finished once their group's hash is."""

        def complete() -> None:
            _complete(pending.popleft(), held, checker is not None, stats)

        try:
            for chunk in work:
                segments, finished = _segments(chunk, open_targets, target_for, checker)
                after, closing = None, None
                if checker is not None and hashers is not None:
                    group = group or _HashGroup(checker, hashers, chunk.file, chunk.begin)
                    group, after, closing = _hash_read(group, checker, chunk, segments)
                while len(pending) >= 2 * self.depth:
                    complete()
                future = pool.submit(_read_segments, store, chunk, segments, stats, after)
                pending.append((future, finished, closing))
            while pending:
                complete()
            if held:  # a bug, not a bad artifact: the last read of a file closes its group
                raise AssertionError(f"targets left unchecked: {len(held)}")
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if hashers is not None:
                hashers.shutdown(wait=True, cancel_futures=True)
        # Reads land in the parameters: on a host, the transfer *is* the read.
        stats._close()
        stats.copy_seconds += stats.read_seconds

    def _pipeline(
        self,
        store: RankBytes,
        work: Iterator[_Chunk],
        target_for: TargetFor,
        stats: ReadStats,
        checker: ChunkChecker | None,
    ) -> None:
        free: collections.deque[tuple[torch.Tensor, torch.cuda.Event | None]] = collections.deque(
            (b, None) for b in self.buffers
        )
        pending: collections.deque[tuple[_Chunk, torch.Tensor, Future[Hashed]]] = (
            collections.deque()
        )
        open_targets: dict[str, Target] = {}
        timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        pool = ThreadPoolExecutor(self.depth, thread_name_prefix="modelstage-read")
        hashers = _hash_pool(checker)

        def submit() -> None:
            chunk = next(work, None)
            if chunk is None:
                return
            buf, copied = free.popleft()
            if copied is not None:
                copied.synchronize()  # the buffer's last copy must be done before reuse
            after = None
            if checker is not None and hashers is not None:
                view = buf.numpy().data[: chunk.end - chunk.begin]
                after = functools.partial(
                    hashers.submit, checker.check, chunk.file, chunk.begin, [view]
                )
            future = pool.submit(_read_chunk, store, chunk, buf, stats, after)
            pending.append((chunk, buf, future))

        try:
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream())
            for _ in range(self.depth):
                submit()
            while pending:
                chunk, buf, future = pending.popleft()
                waited = time.perf_counter()
                _wait(future)  # checked before a byte of it reaches the device
                copy_start = time.perf_counter()
                stats.wait_seconds += copy_start - waited
                copied = self._copy(chunk, buf, target_for, open_targets, timings)
                if not self.cuda:
                    stats.copy_seconds += time.perf_counter() - copy_start
                free.append((buf, copied))
                submit()
            if self.stream is not None:
                self.stream.synchronize()
                torch.cuda.current_stream().wait_stream(self.stream)
                stats.copy_seconds = sum(a.elapsed_time(b) for a, b in timings) / 1000
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if open_targets:  # a bug, not a bad artifact: chunks() covers every byte
            raise AssertionError(f"tensors left incomplete: {sorted(open_targets)[:3]}")

    def _copy(
        self,
        chunk: _Chunk,
        buf: torch.Tensor,
        target_for: TargetFor,
        open_targets: dict[str, Target],
        timings: list[tuple[torch.cuda.Event, torch.cuda.Event]],
    ) -> torch.cuda.Event | None:
        """Copy one chunk into every tensor it covers; returns the event that frees ``buf``."""
        start = end = None
        if self.stream is not None:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(self.stream)
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for info in chunk.tensors:
                target = open_targets.get(info.name)
                if target is None:
                    target = open_targets[info.name] = target_for(info)
                lo, hi = max(info.begin, chunk.begin), min(info.end, chunk.end)
                target.flat[lo - info.begin : hi - info.begin].copy_(
                    buf[lo - chunk.begin : hi - chunk.begin], non_blocking=True
                )
                if hi == info.end:  # staging lives on the host: its copy is synchronous
                    _finish(open_targets.pop(info.name))
        if start is not None and end is not None and self.stream is not None:
            end.record(self.stream)
            timings.append((start, end))
        return end


Hashed = Future[None] | None
"""What a read returns: the future of its hash, when checking."""


def _complete(
    read: tuple[Future[Hashed], list[Target], _HashGroup | None],
    held: list[Target],
    hashing: bool,
    stats: ReadStats,
) -> None:
    """The oldest direct read is done: its targets are held until their hash group is
    checked (at once when not hashing), then finished."""
    future, finished, closing = read
    waited = time.perf_counter()
    future.result()
    held.extend(finished)
    if hashing and closing is None:  # the group's later reads are to come
        stats.wait_seconds += time.perf_counter() - waited
        return
    if closing is not None:  # the read that completed a group: wait for its hash
        closing.wait()
    finishing = time.perf_counter()
    stats.wait_seconds += finishing - waited
    for target in held:
        if target.finish is not None:
            target.finish()
    held.clear()
    stats.copy_seconds += time.perf_counter() - finishing


def _segments(
    chunk: _Chunk,
    open_targets: dict[str, tuple[Target, memoryview]],
    target_for: TargetFor,
    checker: ChunkChecker | None,
) -> tuple[list[tuple[int, memoryview]], list[Target]]:
    """One direct read's iovecs: each tensor piece of ``chunk`` straight into its target's
    memory (and, when hashing, the header or a hole into a scratch buffer: read, hashed,
    dropped); and the targets whose last byte this read brings."""
    segments: list[tuple[int, memoryview]] = []
    finished: list[Target] = []
    at = chunk.begin
    for info in chunk.tensors:
        entry = open_targets.get(info.name)
        if entry is None:
            target = target_for(info)
            entry = open_targets[info.name] = (target, target.flat.numpy().data)
        lo, hi = max(info.begin, chunk.begin), min(info.end, chunk.end)
        if checker is not None and lo > at:
            segments.append((at, memoryview(bytearray(lo - at))))
        segments.append((lo, entry[1][lo - info.begin : hi - info.begin]))
        at = hi
        if hi == info.end:
            finished.append(open_targets.pop(info.name)[0])
    if checker is not None and at < chunk.end:
        segments.append((at, memoryview(bytearray(chunk.end - at))))
    return segments, finished


def _hash_read(
    group: _HashGroup,
    checker: ChunkChecker,
    chunk: _Chunk,
    segments: list[tuple[int, memoryview]],
) -> tuple[_HashGroup | None, Callable[[], Hashed], _HashGroup | None]:
    """Add a direct read to the hash group of its chunk: (the group still open, what the read
    calls once done, the group this read closes)."""
    group.add([v for _, v in segments])
    after = group.read_done
    _, digest = checker.files[chunk.file]
    if chunk.end % digest.chunk_bytes == 0 or chunk.end == digest.size:
        group.close()
        return None, after, group
    return group, after, None


def _hash_pool(checker: ChunkChecker | None) -> ThreadPoolExecutor | None:
    if checker is None:
        return None
    return ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="modelstage-hash")


def _wait(read: Future[Hashed]) -> None:
    """A read and then its hash (``ChunkMismatch`` raises here, in the loading thread)."""
    hashed = read.result()
    if hashed is not None:
        hashed.result()


class _HashGroup:
    """Consecutive reads of one file that together hold whole hash chunks (one read of
    several chunks, or the reads of one chunk larger than a read): hashed, on the hashing
    threads, as soon as the last of them is in, whatever order they complete in."""

    def __init__(
        self, checker: ChunkChecker, hashers: ThreadPoolExecutor, file: int, begin: int
    ) -> None:
        self.checker, self.hashers, self.file, self.begin = checker, hashers, file, begin
        self.views: list[memoryview] = []
        self.reads = self.done = 0
        self.closed = False
        self.future: Future[None] | None = None
        self._lock = threading.Lock()

    def add(self, views: list[memoryview]) -> None:
        """A read of the group was planned (in file order)."""
        with self._lock:
            self.views.extend(views)
            self.reads += 1

    def close(self) -> None:
        """The group's last read was planned."""
        with self._lock:
            self.closed = True

    def read_done(self) -> Hashed:
        """On a read thread, after one of the group's reads."""
        with self._lock:
            self.done += 1
            ready = self.closed and self.done == self.reads
        if ready:
            self.future = self.hashers.submit(self.checker.check, self.file, self.begin, self.views)
        return None

    def wait(self) -> None:
        """Once every read of the group is in: wait for its hash (``ChunkMismatch``)."""
        assert self.future is not None, "a group's hash is submitted by its last read"
        self.future.result()


def _read_segments(
    store: RankBytes,
    chunk: _Chunk,
    segments: list[tuple[int, memoryview]],
    stats: ReadStats,
    after: Callable[[], Hashed] | None = None,
) -> Hashed:
    """Fill ``(file offset, view)`` segments (in file order): back-to-back ones with one
    store read each, a hole between tensors starts another; then call ``after`` (hand what
    was read to the hashing threads)."""
    start, i = time.perf_counter(), 0
    while i < len(segments):
        offset, first = segments[i]
        run, end, i = [first], offset + len(first), i + 1
        while i < len(segments) and segments[i][0] == end:
            run.append(segments[i][1])
            end += len(segments[i][1])
            i += 1
        store.read_into(chunk.file, offset, run)
    stats._read_done(start, time.perf_counter(), sum(len(v) for _, v in segments))
    return after() if after is not None else None


def _read_chunk(
    store: RankBytes,
    chunk: _Chunk,
    buf: torch.Tensor,
    stats: ReadStats,
    after: Callable[[], Hashed] | None = None,
) -> Hashed:
    view = buf.numpy().data[: chunk.end - chunk.begin]
    return _read_segments(store, chunk, [(chunk.begin, view)], stats, after)


def _finish(target: Target) -> None:
    if target.finish is not None:
        target.finish()


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-D uint8 view (0-d tensors included)."""
    return tensor.reshape(-1).view(torch.uint8)


def staging_for(info: TensorInfo, dest: torch.Tensor) -> Target:
    """A host staging tensor for ``info``, copied into ``dest`` with ``copy_`` semantics
    (dtype conversion, strided destinations) once complete."""
    staging = torch.empty(info.nbytes, dtype=torch.uint8)

    def finish() -> None:
        dest.copy_(staging.view(TORCH_DTYPES[info.dtype]).reshape(info.shape))

    return Target(staging, finish)
