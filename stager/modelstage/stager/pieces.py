"""The bytes a rank writer hands a sink, and the one copy that lands them in the sink's buffer.

A *piece* is one of:

- contiguous bytes in memory (a ``memoryview``): rows read ahead once and shared by ranks,
  or bytes made here (casts, headers, zeros);
- a column cut of rows (a 2-D ``uint8`` array whose rows are contiguous but spaced by the
  source row's length): a row-parallel weight's share, gathered by the sink's copy instead
  of first being made contiguous in a fresh array of its own;
- ``SourceBytes``: a byte range of a source file that only this rank needs, read by the
  sink straight into its buffer (``preadv``), so those bytes are never copied in user space.

Every copy releases the GIL (numpy, ``preadv``), so each rank's writer thread copies and
hashes on its own core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray


class RangeReader(Protocol):
    def read_range(self, name: str, offset: int, out: memoryview) -> None: ...


@dataclass(frozen=True)
class SourceBytes:
    source: RangeReader
    name: str
    offset: int
    nbytes: int


Piece = memoryview | NDArray[np.uint8] | SourceBytes


def piece_nbytes(piece: Piece) -> int:
    return int(piece.nbytes)


def copy_piece(piece: Piece, start: int, dst: NDArray[np.uint8]) -> int:
    """Copy the piece's bytes from offset ``start`` (row-major for a column cut) into ``dst``
    (1-D uint8), as many as fit; returns how many."""
    n = int(min(dst.size, piece.nbytes - start))
    if n <= 0:
        return 0
    if isinstance(piece, SourceBytes):
        piece.source.read_range(piece.name, piece.offset + start, dst[:n].data)
        return n
    if isinstance(piece, memoryview):
        dst[:n] = np.frombuffer(piece, dtype=np.uint8)[start : start + n]
        return n
    return _copy_rows(piece, start, n, dst)


def _copy_rows(rows: NDArray[np.uint8], start: int, n: int, dst: NDArray[np.uint8]) -> int:
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.strides[1] != 1:
        raise ValueError("a column cut is a 2-D uint8 array with contiguous rows")
    width = rows.shape[1]
    row, col = divmod(start, width)
    done = 0
    if col:  # the rest of a row begun by the previous copy
        k = min(width - col, n)
        dst[:k] = rows[row, col : col + k]
        done, row = k, row + 1
    full = (n - done) // width
    if full:
        dst[done : done + full * width].reshape(full, width)[...] = rows[row : row + full]
        done, row = done + full * width, row + full
    if done < n:  # the start of a row the next copy finishes
        dst[done:n] = rows[row, : n - done]
    return n
