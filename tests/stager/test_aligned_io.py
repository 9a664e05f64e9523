"""The aligned writer and the pieces it copies: every byte lands once, in order, hashed."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from modelstage.stager import aligned_io
from modelstage.stager.aligned_io import ALIGN, AlignedWriter
from modelstage.stager.pieces import Piece, SourceBytes, copy_piece
from modelstage.stager.sources.local import LocalSource


def _expected(piece: Piece) -> bytes:
    if isinstance(piece, SourceBytes):
        out = bytearray(piece.nbytes)
        piece.source.read_range(piece.name, piece.offset, memoryview(out))
        return bytes(out)
    if isinstance(piece, memoryview):
        return piece.tobytes()
    return np.ascontiguousarray(piece).tobytes()


def direct_writes_work(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` takes an ``O_DIRECT`` write: opened with the
    flag and written from an aligned buffer, as the writer does (some filesystems refuse at
    ``open``, some at the first write)."""
    path = directory / "o_direct_probe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT)
    except OSError as e:
        assert e.errno == errno.EINVAL, e
        return False
    try:
        buf = mmap.mmap(-1, ALIGN)
        buf.write(b"x" * ALIGN)
        try:
            return os.pwrite(fd, memoryview(buf), 0) == ALIGN
        except OSError as e:
            assert e.errno == errno.EINVAL, e
            return False
    finally:
        os.close(fd)
        path.unlink()


@pytest.fixture
def direct_supported(tmp_path: Path) -> bool:
    """ext4, xfs and btrfs take direct writes, tmpfs does not; where they are refused, the
    tests that need them say so (skipped), so the direct path never goes silently untested."""
    return direct_writes_work(tmp_path)


def _pieces(source_dir: Path, seed: int) -> list[Piece]:
    """Contiguous bytes, column cuts of odd widths, and source ranges, in a random mix."""
    rng = np.random.default_rng(seed)
    blob = rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    (source_dir / "blob.bin").write_bytes(blob)
    source = LocalSource(str(source_dir))
    pieces: list[Piece] = []
    for _ in range(12):
        kind = rng.integers(3)
        if kind == 0:
            pieces.append(memoryview(rng.integers(0, 256, int(rng.integers(1, 9000)),
                                                  dtype=np.uint8).tobytes()))  # fmt: skip
        elif kind == 1:
            rows, width = int(rng.integers(1, 40)), int(rng.integers(2, 700))
            grid = rng.integers(0, 256, (rows, width), dtype=np.uint8)
            lo = int(rng.integers(0, width - 1))
            pieces.append(grid[:, lo : int(rng.integers(lo + 1, width + 1))])
        else:
            offset = int(rng.integers(0, 40_000))
            pieces.append(SourceBytes(source, "blob.bin", offset, int(rng.integers(1, 10_000))))
    return pieces


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("buffer_bytes", [ALIGN, 3 * ALIGN, 1 << 20])
def test_every_byte_lands_once_in_order_and_is_hashed(
    tmp_path: Path, direct: bool, buffer_bytes: int, direct_supported: bool
) -> None:
    if direct and not direct_supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT writes: the direct path is untested here")
    pieces = _pieces(tmp_path, seed=buffer_bytes + direct)
    expected = b"".join(_expected(p) for p in pieces)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    os.posix_fallocate(fd, 0, len(expected))
    writer = AlignedWriter(fd, direct=direct, buffer_bytes=buffer_bytes)
    assert writer.direct == (direct and direct_supported)
    digest = hashlib.sha256()
    assert sum(writer.write(p, digest) for p in pieces) == len(expected)
    assert writer.direct == (direct and direct_supported), "fell back to buffered writes"
    writer.finish(len(expected))
    os.close(fd)
    assert path.read_bytes() == expected  # the padded O_DIRECT tail is cut off
    assert digest.hexdigest() == hashlib.sha256(expected).hexdigest()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 30), width=st.integers(1, 50), data=st.data(),
    room=st.integers(1, 97), start_frac=st.floats(0, 1),
)  # fmt: skip
def test_copy_piece_copies_a_column_cut_in_row_major_order_from_any_offset(
    rows: int, width: int, data: st.DataObject, room: int, start_frac: float
) -> None:
    lo = data.draw(st.integers(0, width - 1))
    hi = data.draw(st.integers(lo + 1, width))
    grid = np.arange(rows * width, dtype=np.uint32).astype(np.uint8).reshape(rows, width)
    cut = grid[:, lo:hi]
    flat = np.ascontiguousarray(cut).reshape(-1)
    start = int(start_frac * (flat.size - 1))
    dst = np.zeros(room, dtype=np.uint8)
    n = copy_piece(cut, start, dst)
    assert n == min(room, flat.size - start)
    assert dst[:n].tobytes() == flat[start : start + n].tobytes()


def test_a_filesystem_that_refuses_direct_writes_gets_buffered_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_supported: bool
) -> None:
    """Some filesystems accept ``O_DIRECT`` at ``fcntl`` and refuse the writes (EINVAL)."""
    if not direct_supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT: a refusal at the first write cannot be shown")
    real_pwrite = os.pwrite
    refused = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(aligned_io.os, "pwrite", pwrite)
    data = os.urandom(40 * ALIGN + 123)  # 21 writes, a file's buffers' worth in flight at most
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    writer = AlignedWriter(fd, direct=True, buffer_bytes=2 * ALIGN)
    was_direct = writer.direct
    writer.write(memoryview(data))
    writer.finish(len(data))
    os.close(fd)
    assert path.read_bytes() == data
    assert was_direct, "the writer did not try O_DIRECT on a filesystem that takes it"
    # Every buffer of the file may be in flight (in any order) when the first refusal comes;
    # every later write waits for one of them, so it is never tried with O_DIRECT.
    assert refused, "no direct write was tried"
    first = {i * 2 * ALIGN for i in range(aligned_io.MAX_BUFFERS_PER_FILE)}
    assert set(refused) <= first, f"direct writes tried after a refusal: {refused}"
    assert not writer.direct


def test_direct_io_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(aligned_io.DIRECT_IO_ENV, "0")
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    writer = AlignedWriter(fd, direct=True)
    writer.write(memoryview(b"x" * 5000))
    writer.finish(5000)
    os.close(fd)
    assert not writer.direct
    assert (tmp_path / "out.bin").read_bytes() == b"x" * 5000


def test_buffer_sizes_must_be_aligned(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with pytest.raises(ValueError, match="multiple of 4096"):
            AlignedWriter(fd, direct=False, buffer_bytes=5000)
    finally:
        os.close(fd)


def test_buffers_scale_with_the_file_between_64_kib_and_8_mib() -> None:
    from modelstage.stager.aligned_io import BUFFER_BYTES, MIN_BUFFER_BYTES, buffer_bytes_for

    assert buffer_bytes_for(0) == MIN_BUFFER_BYTES
    assert buffer_bytes_for(10 * 2**20) % ALIGN == 0
    assert MIN_BUFFER_BYTES < buffer_bytes_for(10 * 2**20) < BUFFER_BYTES
    assert buffer_bytes_for(10 * 2**30) == BUFFER_BYTES


class _GatedWrites:
    """``os.pwrite`` held until ``expected`` writes are in flight at once (or 10 s passed):
    the peak then shows how many writes the writer keeps in flight."""

    def __init__(self, expected: int) -> None:
        import threading

        self.expected, self.now, self.peak = expected, 0, 0
        self.lock, self.open = threading.Lock(), threading.Event()
        self.real = os.pwrite

    def __call__(self, fd: int, data: memoryview, offset: int) -> int:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            if self.now >= self.expected:
                self.open.set()
        if not self.open.wait(10):
            self.open.set()  # it never came: let the rest through, the peak tells
        try:
            return self.real(fd, data, offset)
        finally:
            with self.lock:
                self.now -= 1


def _open(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def test_one_large_file_keeps_several_writes_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One file alone (TP=1) takes extra buffers from the shared budget: the disk's queue
    holds ``MAX_BUFFERS_PER_FILE`` of its writes, not one."""
    gate = _GatedWrites(aligned_io.MAX_BUFFERS_PER_FILE)
    monkeypatch.setattr(aligned_io.os, "pwrite", gate)
    data = os.urandom(30 * 2 * ALIGN)
    fd = _open(tmp_path / "out.bin")
    writer = AlignedWriter(fd, direct=False, buffer_bytes=2 * ALIGN)
    writer.write(memoryview(data))
    writer.finish(len(data))
    os.close(fd)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert gate.peak == aligned_io.MAX_BUFFERS_PER_FILE


def test_files_past_the_shared_budget_keep_their_own_two_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many files at once (TP=8) already keep the queue full: no file takes extras past the
    budget, so memory stays ``BUFFERS_PER_FILE`` buffers a file; what a finished file gives
    back is there for the others."""
    size = 2 * ALIGN
    budget = aligned_io.MAX_BUFFERS_PER_FILE - 1  # buffers: two files' own ones exceed it
    assert 2 * aligned_io.BUFFERS_PER_FILE > budget > aligned_io.BUFFERS_PER_FILE
    monkeypatch.setattr(aligned_io, "SHARED_BUFFER_BYTES", budget * size)
    data = os.urandom(20 * size)
    fds = [_open(tmp_path / f"{i}.bin") for i in range(2)]
    first, second = (AlignedWriter(fd, direct=False, buffer_bytes=size) for fd in fds)
    first.write(memoryview(data))
    assert len(first.buffers) == aligned_io.BUFFERS_PER_FILE
    second.write(memoryview(data))
    second.finish(len(data))
    first.write(memoryview(data))
    assert len(first.buffers) == budget
    first.finish(2 * len(data))
    for fd in fds:
        os.close(fd)
    assert (tmp_path / "0.bin").read_bytes() == data + data
    assert (tmp_path / "1.bin").read_bytes() == data
