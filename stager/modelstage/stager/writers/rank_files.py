"""Executes a shard plan: streams source bytes once and appends each rank's slices to its file.

The pipeline: rows that exactly one rank takes, unconverted, from a local source (most of
a checkpoint: column-parallel weights, vocab shards, everything at TP=1) are read by that
rank's writer straight into its sink's buffer. Everything else is read ahead once by a
reader thread into reused buffers (only the rows some rank needs), and the main thread cuts
each chunk into per-rank pieces without copying (shared rows, or a column cut as a strided
view; only dtype casts copy here). One writer thread per rank hands its pieces to its sink
in order, and the sink's one copy into its own buffer also gathers column cuts and feeds
the chunk hashes (``pieces.py``, ``integrity.py``). Memory is bounded by the buffer pools,
not by the checkpoint's size.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import threading
from collections.abc import Callable, Container, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from modelstage.core.architectures import NON_LAYER_GROUP
from modelstage.core.formats import Format
from modelstage.core.integrity import FileDigest
from modelstage.core.layouts import Layout
from modelstage.core.progress import Progress
from modelstage.core.safetensors_format import encode_header

from ..checkpoint import Checkpoint
from ..destinations.base import Completed, Destination, OpenSink, Sink
from ..pieces import Piece, SourceBytes
from ..shard_plan import ShardPlan, Slot, TargetTensor
from .base import PlannedFile, WriteJob, Writer

CHUNK_BYTES = 32 * 1024 * 1024
POOL_BUFFERS = 4
ZEROS = bytes(4 * 1024 * 1024)
PART_METADATA = {"format": "pt"}


def plan_parts(plan: ShardPlan, max_part_bytes: int) -> list[list[TargetTensor]]:
    """Split a rank's tensors into part files of at most ``max_part_bytes`` (one if larger).

    Parts are cut only between whole *groups* (``TargetTensor.group``: one decoder layer, or
    embeddings + final norm + head together), packed in group order, non-layer group first;
    inside a part the tensors keep the plan's order (so a one-part rank is the plan itself).
    The layout is a function of the plan and ``max_part_bytes`` alone, never of how many
    workers write it: that is what makes an n-way staged artifact byte-identical to a 1-way
    one, and a fused tensor is one target, so it never spans two files.
    """
    units: dict[int, list[int]] = {}
    for i, target in enumerate(plan.targets):
        units.setdefault(target.group, []).append(i)
    order = sorted(units, key=lambda g: g != NON_LAYER_GROUP)  # stable: layers keep their order
    parts: list[list[int]] = [[]]
    size = 0
    for group in order:
        nbytes = sum(plan.targets[i].nbytes for i in units[group])
        if parts[-1] and size + nbytes > max_part_bytes:
            parts.append([])
            size = 0
        parts[-1].extend(units[group])
        size += nbytes
    return [[plan.targets[i] for i in sorted(part)] for part in parts]


def rank_file_names(fmt: Format, plan: ShardPlan, parts: int) -> list[list[str]]:
    """``names[rank][part]``: the part files of every tensor-parallel rank of the plan's
    pipeline stage, named by the format table."""
    return [
        [fmt.rank_file_name(r, p, plan.pp_rank, plan.pp) for p in range(parts)]
        for r in range(plan.tp)
    ]


def part_sizes(parts: Sequence[Sequence[TargetTensor]]) -> list[int]:
    """Each part file's exact size (header + data); equal on every rank."""
    sizes = []
    for part in parts:
        header, _ = encode_header([(t.name, t.dtype, t.shape) for t in part], PART_METADATA)
        sizes.append(len(header) + sum(t.nbytes for t in part))
    return sizes


class RankFilesWriter(Writer):
    """Each rank's part files of the shard plan, in vLLM's sharded-state layout."""

    def write(self, job: WriteJob, dest: Destination, progress: Progress) -> dict[str, FileDigest]:
        return write_rank_files(
            job.plan,
            job.checkpoint,
            job.layout,
            job.format,
            dest.open_sink,
            progress,
            dest.completed,
        )

    def planned(self, job: WriteJob) -> list[PlannedFile]:
        parts = plan_parts(job.plan, job.layout.max_part_bytes)
        tp = job.plan.tp
        names, sizes = rank_file_names(job.format, job.plan, len(parts)), part_sizes(parts)
        return [PlannedFile(names[r][p], sizes[p], r) for r in range(tp) for p in range(len(parts))]


def write_rank_files(
    plan: ShardPlan,
    checkpoint: Checkpoint,
    layout: Layout,
    fmt: Format,
    open_sink: OpenSink,
    progress: Progress,
    completed: Completed | None = None,
    only: Container[int] | None = None,
) -> dict[str, FileDigest]:
    """Write every rank's part files; returns {file name: its digest}.

    ``completed`` names files an earlier run already wrote (a resumed S3 upload): a part
    whose files are all complete is not read at all; in a partly complete part the complete
    ranks' bytes are dropped instead of written again. ``only`` restricts the run to those
    part indices (a scale-out worker's share, see ``scale_out.py``).
    """
    parts = plan_parts(plan, layout.max_part_bytes)
    names = rank_file_names(fmt, plan, len(parts))
    results: dict[str, FileDigest] = {}
    for p, part in enumerate(parts):
        if only is not None and p not in only:
            continue
        header, _ = encode_header([(t.name, t.dtype, t.shape) for t in part], PART_METADATA)
        size = len(header) + sum(t.nbytes for t in part)
        done = [completed(names[r][p], size) if completed else None for r in range(plan.tp)]
        reused = [d for d in done if d is not None]
        if len(reused) == plan.tp:
            results.update(zip((names[r][p] for r in range(plan.tp)), reused, strict=True))
            for _ in part:
                progress.tensor_done()
            continue
        sinks: list[Sink] = [
            open_sink(names[r][p], size) if (d := done[r]) is None else _DoneSink(d)
            for r in range(plan.tp)
        ]
        try:
            with _RankStreams(sinks) as streams:
                for r in range(plan.tp):
                    streams.append(r, memoryview(header))
                _stream_part(part, checkpoint, streams, progress)
            for r, sink in enumerate(sinks):
                results[names[r][p]] = sink.close()
        except BaseException:
            for sink in sinks:
                sink.abort()
            raise
    return results


class _DoneSink:
    """Stands in for a file that is already complete: drops its bytes, returns its entry."""

    def __init__(self, entry: FileDigest) -> None:
        self.entry = entry

    def write(self, data: Piece) -> None:
        pass

    def close(self) -> FileDigest:
        return self.entry

    def abort(self) -> None:
        pass


class _RankStreams:
    """One single-thread executor per rank keeps each rank's appends in order."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = sinks
        self.executors = [ThreadPoolExecutor(1, f"rank{r}") for r in range(len(sinks))]
        self.pending: list[Future[None]] = []

    def append(self, rank: int, data: Piece, on_done: Callable[[], None] | None = None) -> None:
        future = self.executors[rank].submit(self.sinks[rank].write, data)
        if on_done is not None:
            future.add_done_callback(lambda _f: on_done())
        self.pending.append(future)
        if len(self.pending) > 256:
            self._reap()

    def _reap(self) -> None:
        still = []
        for f in self.pending:
            if f.done():
                f.result()  # re-raises a writer's error here, in the main thread
            else:
                still.append(f)
        self.pending = still

    def __enter__(self) -> _RankStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        for ex in self.executors:
            ex.shutdown(wait=True)
        if exc[0] is None:
            for f in self.pending:
                f.result()


@dataclass(frozen=True)
class _Chunk:
    """Rows ``[first_row, last_row)`` of one slot's source tensor."""

    target: TargetTensor
    slot: Slot
    first_row: int
    last_row: int  # exclusive
    row_bytes: int
    col_bytes: int  # bytes of one index of dim 1 (0 for 1-D tensors)
    src_dtype: str

    @property
    def nbytes(self) -> int:
        return (self.last_row - self.first_row) * self.row_bytes


@dataclass(frozen=True)
class _Fixed:
    """Bytes that come from no source: a 0-d constant (slot None) or a zero-row slot."""

    target: TargetTensor
    slot: Slot | None


@dataclass(frozen=True)
class _Direct:
    """A slot whose ranks take disjoint whole rows, unconverted: each rank's writer reads its
    own rows straight from the source into its sink (``SourceBytes``); nothing is read ahead."""

    target: TargetTensor
    slot: Slot
    file: str
    begin: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(sel.num_rows for sel in self.slot.per_rank) * self.row_bytes


@dataclass(frozen=True)
class _TargetDone:
    target: TargetTensor


_Item = _Chunk | _Fixed | _Direct | _TargetDone


def _disjoint_whole_rows(slot: Slot) -> bool:
    """Every rank takes whole rows, as they are, and no row goes to two ranks."""
    if slot.transposed or any(sel.cols is not None for sel in slot.per_rank):
        return False
    spans = sorted(sel.rows for sel in slot.per_rank if sel.num_rows)
    return all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def _items(part: list[TargetTensor], checkpoint: Checkpoint) -> Iterator[_Item]:
    """Work in file order; every rank receives its bytes in exactly this order."""
    direct = checkpoint.source.direct_reads
    for target in part:
        if target.constant is not None:
            yield _Fixed(target, None)
        for slot in target.slots:
            if slot.source is None:
                yield _Fixed(target, slot)
                continue
            info = checkpoint.tensors[slot.source]
            row_bytes, col_bytes = _matrix_bytes(info.shape, info.nbytes)
            if direct and info.dtype == target.dtype and _disjoint_whole_rows(slot):
                yield _Direct(target, slot, info.file, info.begin, row_bytes)
                continue
            lo = min(s.rows[0] for s in slot.per_rank)
            hi = max(s.rows[1] for s in slot.per_rank)
            step = max(1, hi - lo if slot.transposed else CHUNK_BYTES // max(row_bytes, 1))
            for first in range(lo, hi, step):
                last = min(first + step, hi)
                yield _Chunk(target, slot, first, last, row_bytes, col_bytes, info.dtype)
        yield _TargetDone(target)


def _matrix_bytes(shape: Sequence[int], nbytes: int) -> tuple[int, int]:
    """Bytes of one row and of one column index of a source read as a matrix (every dim but
    the last is rows; a 1-D tensor's rows are its elements, which have no columns)."""
    rows = math.prod(shape[:-1]) if len(shape) > 1 else (shape[0] if shape else 1)
    row_bytes = nbytes // rows if rows else 0
    col_bytes = row_bytes // shape[-1] if len(shape) > 1 and shape[-1] else 0
    return row_bytes, col_bytes


def _chunk_bytes(slot: Slot, checkpoint: Checkpoint) -> int:
    """The largest read of one slot: a row, or a transposed slot's rows whole (one expert)."""
    info = checkpoint.tensors[slot.source or ""]
    row_bytes, _ = _matrix_bytes(info.shape, info.nbytes)
    if not slot.transposed:
        return row_bytes
    rows = max(s.rows[1] for s in slot.per_rank) - min(s.rows[0] for s in slot.per_rank)
    return rows * row_bytes


class _BufferPool:
    """``count`` buffers of ``size`` bytes, each made when first needed (a part of whole
    rows alone, e.g. everything at TP=1, never needs one)."""

    def __init__(self, count: int, size: int) -> None:
        self.free: queue.Queue[bytearray] = queue.Queue()
        self.unmade, self.size = count, size

    def acquire(self, cancel: threading.Event) -> bytearray | None:
        if self.free.empty() and self.unmade:
            self.unmade -= 1
            return bytearray(self.size)
        while not cancel.is_set():
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def release_after(self, buf: bytearray, count: int) -> Callable[[], None]:
        """A callback that returns ``buf`` to the pool once called ``count`` times."""
        remaining = [count]
        lock = threading.Lock()

        def done() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self.free.put(buf)

        return done


_Filled = tuple[_Item, bytearray | None] | BaseException | None


def _stream_part(
    part: list[TargetTensor], checkpoint: Checkpoint, streams: _RankStreams, progress: Progress
) -> None:
    largest = max(
        (_chunk_bytes(s, checkpoint) for t in part for s in t.slots if s.source is not None),
        default=0,
    )
    pool = _BufferPool(POOL_BUFFERS, max(CHUNK_BYTES, largest))
    filled: queue.Queue[_Filled] = queue.Queue(maxsize=POOL_BUFFERS)
    cancel = threading.Event()

    def read_ahead() -> None:
        try:
            for item in _items(part, checkpoint):
                if not isinstance(item, _Chunk):
                    filled.put((item, None))
                    continue
                buf = pool.acquire(cancel)
                if buf is None:
                    return
                info = checkpoint.tensors[item.slot.source or ""]
                offset = info.begin + item.first_row * item.row_bytes
                checkpoint.source.read_range(info.file, offset, memoryview(buf)[: item.nbytes])
                filled.put((item, buf))
            filled.put(None)
        except BaseException as e:  # handed to the main thread, which raises it
            filled.put(e)

    reader = threading.Thread(target=read_ahead, name="reader", daemon=True)
    reader.start()
    try:
        while (got := filled.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            item, buf = got
            if isinstance(item, _Fixed):
                _write_fixed(item, streams)
            elif isinstance(item, _Direct):
                _read_direct(item, checkpoint, streams)
                progress.advance(item.nbytes)
            elif isinstance(item, _TargetDone):
                progress.tensor_done()
            else:
                assert buf is not None
                _scatter(item, buf, streams, pool)
                progress.advance(item.nbytes)
    finally:
        cancel.set()
        while reader.is_alive():  # unblock a reader waiting on a full queue
            with contextlib.suppress(queue.Empty):
                filled.get(timeout=0.1)
        reader.join()


def _write_fixed(item: _Fixed, streams: _RankStreams) -> None:
    target = item.target
    if item.slot is None:
        data = memoryview(_scalar_bytes(target.constant or 0.0, target.dtype))
        for r in range(len(streams.sinks)):
            streams.append(r, data)
        return
    row_bytes = target.nbytes // target.shape[0]
    for r, sel in enumerate(item.slot.per_rank):
        remaining = sel.num_rows * row_bytes
        while remaining:
            n = min(remaining, len(ZEROS))
            streams.append(r, memoryview(ZEROS)[:n])
            remaining -= n


def _read_direct(item: _Direct, checkpoint: Checkpoint, streams: _RankStreams) -> None:
    for r, sel in enumerate(item.slot.per_rank):
        if sel.num_rows:
            offset = item.begin + sel.rows[0] * item.row_bytes
            piece = SourceBytes(checkpoint.source, item.file, offset, sel.num_rows * item.row_bytes)
            streams.append(r, piece)


def _scatter(item: _Chunk, buf: bytearray, streams: _RankStreams, pool: _BufferPool) -> None:
    """Cut one chunk into each rank's bytes and queue them; the buffer returns when written."""
    views: list[tuple[int, Piece]] = []
    for r, sel in enumerate(item.slot.per_rank):
        a, b = max(sel.rows[0], item.first_row), min(sel.rows[1], item.last_row)
        if a >= b:
            continue
        lo, hi = (a - item.first_row) * item.row_bytes, (b - item.first_row) * item.row_bytes
        rows = memoryview(buf)[lo:hi]
        view: Piece = rows
        if item.slot.transposed:
            view = _transposed(rows, b - a, item, sel.cols)
        elif sel.cols is not None:  # the sink gathers the cut in its own copy
            grid = np.frombuffer(rows, dtype=np.uint8).reshape(b - a, item.row_bytes)
            view = grid[:, sel.cols[0] * item.col_bytes : sel.cols[1] * item.col_bytes]
        if item.src_dtype != item.target.dtype:
            contiguous = np.ascontiguousarray(view).data.cast("B")
            view = cast_bytes(contiguous, item.src_dtype, item.target.dtype)
        views.append((r, view))
    if not views:
        pool.free.put(buf)
        return
    release = pool.release_after(buf, len(views))
    for r, view in views:
        streams.append(r, view, release)


def _transposed(
    rows: memoryview, count: int, item: _Chunk, cols: tuple[int, int] | None
) -> memoryview:
    """The cut (``count`` rows, columns ``cols``) transposed, in a copy of its own: elements
    move as unsigned integers of their size, so no value is touched."""
    element = np.dtype(f"<u{item.col_bytes}")
    grid = np.frombuffer(rows, dtype=element).reshape(count, item.row_bytes // item.col_bytes)
    if cols is not None:
        grid = grid[:, cols[0] : cols[1]]
    return np.ascontiguousarray(grid.T).data.cast("B")


_NUMPY_SCALARS = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


def _scalar_bytes(value: float, dtype: str) -> bytes:
    if dtype in _NUMPY_SCALARS:
        return np.array(value, dtype=_NUMPY_SCALARS[dtype]).tobytes()
    return bytes(cast_bytes(memoryview(np.array(value, np.float32).tobytes()), "F32", dtype))


def cast_bytes(data: memoryview, src: str, dst: str) -> memoryview:
    """Cast raw tensor bytes between float dtypes exactly as torch's ``Tensor.to`` does."""
    import torch  # only casts need torch; a plain re-shard never imports it

    dtypes = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
    }
    if src not in dtypes or dst not in dtypes:
        raise ValueError(f"cannot cast {src} to {dst}")
    if len(data) == 0:
        return data
    tensor = torch.frombuffer(bytearray(data), dtype=dtypes[src]).to(dtypes[dst])
    return tensor.view(torch.uint8).numpy().data.cast("B")
