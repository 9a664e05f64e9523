"""Sequential file writes through reused page-aligned buffers, ``O_DIRECT`` where possible.

With ``O_DIRECT`` the disk takes the bytes straight from our buffer: no copy into the page
cache, no dirty pages for writeback to chase, and nothing of a staged artifact left behind
in the node's page cache (or charged to the stager Job's memory cgroup). The price is
alignment: buffer addresses, lengths and file offsets must be multiples of the block size,
so bytes are gathered into aligned buffers (one copy, about 9 GB/s here) and the tail
is padded, then cut off with ``ftruncate``. A filesystem that refuses ``O_DIRECT`` (at
``fcntl`` or at the first write) gets the same buffers written through the page cache.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from .pieces import Piece, copy_piece, piece_nbytes


class Hash(Protocol):
    def update(self, data: memoryview, /) -> None: ...


ALIGN = 4096
"""Memory and file-offset alignment for ``O_DIRECT`` (a page; every block size divides it)."""
BUFFER_BYTES = 8 * 1024 * 1024
"""The largest buffer; a smaller file gets smaller ones (``buffer_bytes_for``)."""
MIN_BUFFER_BYTES = 64 * 1024
WRITES_PER_FILE = 16
BUFFERS_PER_FILE = 2
"""What every file gets: one buffer is written while the next one fills."""
MAX_BUFFERS_PER_FILE = 4
"""A file may take more while the shared budget lasts: writes in flight keep the disk's
queue full (one file alone writes at 2.0 GB/s here with one write in flight, 2.8 with four)."""
SHARED_BUFFER_BYTES = 64 * 1024 * 1024
"""The budget beyond which files get only ``BUFFERS_PER_FILE`` (many files at once already
keep the queue full)."""
DIRECT_MIN_BYTES = 1024 * 1024
"""Smaller files (configs, manifests) are written through the page cache."""
DIRECT_IO_ENV = "MODELSTAGE_DIRECT_IO"
"""``0`` turns ``O_DIRECT`` off (every write goes through the page cache)."""

_WRITERS = ThreadPoolExecutor(8, "aligned-write")
"""Shared by every open file: eight writes in flight in all, at most one per buffer of a file."""


class _BufferPool:
    """Page-aligned anonymous mappings, reused across files, so a run maps each only once."""

    def __init__(self) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()
        self.taken = 0
        """Bytes of buffers held by open files."""

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            self.taken += size
            buf = self._pop(size)
        return buf if buf is not None else self._new(size)

    def take_extra(self, size: int) -> mmap.mmap | None:
        """A buffer beyond a file's own, or None when the shared budget is spent."""
        with self._lock:
            if self.taken + size > SHARED_BUFFER_BYTES:
                return None
            self.taken += size
            buf = self._pop(size)
        return buf if buf is not None else self._new(size)

    def _pop(self, size: int) -> mmap.mmap | None:
        free = self._free.get(size)
        return free.pop() if free else None

    @staticmethod
    def _new(size: int) -> mmap.mmap:
        buf = mmap.mmap(-1, size)
        with contextlib.suppress(OSError, AttributeError):  # fewer pages to pin per write
            buf.madvise(mmap.MADV_HUGEPAGE)
        return buf

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self.taken -= len(buf)
            self._free.setdefault(len(buf), []).append(buf)


_POOL = _BufferPool()


def buffer_bytes_for(file_size: int) -> int:
    """About ``WRITES_PER_FILE`` writes per file, between 64 KiB and 8 MiB each: a small
    file neither pins 16 MiB of buffers nor lands in one write at its very end."""
    share = -(-file_size // WRITES_PER_FILE // ALIGN) * ALIGN
    return min(BUFFER_BYTES, max(MIN_BUFFER_BYTES, share))


def direct_io_allowed() -> bool:
    return os.environ.get(DIRECT_IO_ENV, "1").strip().lower() not in {"0", "false", "off", "no"}


def _set_direct(fd: int, on: bool) -> bool:
    """Switch ``O_DIRECT`` on ``fd``; False when the filesystem refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return True


class AlignedWriter:
    """Appends to ``fd`` from offset 0 through aligned buffers (not thread-safe: one writer).

    The copies (numpy), the hash (BLAKE3) and ``pwrite`` all release the GIL, so other
    files' writers run beside this one on the other cores.
    """

    def __init__(self, fd: int, *, direct: bool, buffer_bytes: int = BUFFER_BYTES) -> None:
        if buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise ValueError(f"buffer size must be a positive multiple of {ALIGN}")
        self.fd, self.buffer_bytes = fd, buffer_bytes
        self.direct = direct and direct_io_allowed() and _set_direct(fd, True)
        self.buffers: list[mmap.mmap] = []
        self.arrays: list[np.ndarray] = []
        for _ in range(BUFFERS_PER_FILE):
            self._add(_POOL.take(buffer_bytes))
        self.free = collections.deque(range(BUFFERS_PER_FILE))
        self.inflight: collections.deque[tuple[Future[None], int]] = collections.deque()
        self.current: int | None = None
        self.fill = 0
        self.offset = 0
        self._lock = threading.Lock()  # guards the O_DIRECT fallback

    def write(self, piece: Piece, digest: Hash | None = None) -> int:
        """Append ``piece``; ``digest`` is updated from the copy in our buffer, while the
        bytes are still in the CPU's cache. Returns the number of bytes."""
        done, total = 0, piece_nbytes(piece)
        while done < total:
            if self.current is None:
                self.current = self._take()
            space = self.arrays[self.current][self.fill :]
            n = copy_piece(piece, done, space)
            if digest is not None:
                digest.update(space[:n].data)
            self.fill += n
            done += n
            if self.fill == self.buffer_bytes:
                self._submit()
        return total

    def finish(self, size: int) -> None:
        """Write what is buffered, wait for every write, and leave the file exactly ``size``."""
        if self.current is not None and self.fill:
            self._submit()
        self._wait_all()
        if os.fstat(self.fd).st_size != size:  # a padded O_DIRECT tail
            os.ftruncate(self.fd, size)
        self.release()

    def release(self) -> None:
        """Return the buffers to the pool (after any write still in flight has ended)."""
        for future, _ in self.inflight:
            future.exception()  # waits; the error, if any, was or will be raised elsewhere
        self.inflight.clear()
        for buf in self.buffers:
            _POOL.give(buf)
        self.buffers, self.arrays, self.current = [], [], None

    def _add(self, buf: mmap.mmap) -> int:
        self.buffers.append(buf)
        self.arrays.append(np.frombuffer(buf, dtype=np.uint8))
        return len(self.buffers) - 1

    def _take(self) -> int:
        """A free buffer: one of ours, else an extra one while the budget lasts, else the
        one whose write ends first."""
        if not self.free and len(self.buffers) < MAX_BUFFERS_PER_FILE:
            extra = _POOL.take_extra(self.buffer_bytes)
            if extra is not None:
                return self._add(extra)
        if not self.free:
            future, index = self.inflight.popleft()
            future.result()
            self.free.append(index)
        return self.free.popleft()

    def _submit(self) -> None:
        assert self.current is not None
        index, length = self.current, self.fill
        if self.direct and length % ALIGN:
            padded = -(-length // ALIGN) * ALIGN
            self.arrays[index][length:padded] = 0
            length = padded
        future = _WRITERS.submit(self._pwrite, index, length, self.offset)
        self.inflight.append((future, index))
        self.offset += self.fill
        self.current, self.fill = None, 0

    def _pwrite(self, index: int, length: int, offset: int) -> None:
        with memoryview(self.buffers[index]) as whole, whole[:length] as view:
            done = 0
            while done < length:
                try:
                    n = os.pwrite(self.fd, view[done:], offset + done)
                except OSError as e:
                    if e.errno != errno.EINVAL or not self._fall_back():
                        raise
                    continue  # the same bytes again, through the page cache
                if n == 0:
                    raise OSError(errno.EIO, "write returned 0")
                done += n

    def _fall_back(self) -> bool:
        """The filesystem took ``O_DIRECT`` at ``fcntl`` but refuses the writes."""
        with self._lock:
            if not self.direct:
                return True
            self.direct = False
            return _set_direct(self.fd, False)

    def _wait_all(self) -> None:
        while self.inflight:
            future, index = self.inflight.popleft()
            future.result()
            self.free.append(index)
