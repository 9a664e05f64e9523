"""The ``tensorizer`` writer: one ``model-rank-%03d.tensors`` per rank in vLLM's tensorized layout.

What vLLM 0.32 writes (``serialize_vllm_model`` in
``vllm/model_executor/model_loader/tensorizer.py``) and what its loader expects, matched here:

- ``TensorSerializer.write_module(model)``: per module of ``named_modules()``, its parameters
  then its buffers, each labelled ``f"{module_name}.{name}"`` with tensor type PARAM or
  BUFFER. The names and per-rank shapes are those of the ``sharded_state`` layout: the same
  :class:`ShardPlan` feeds both writers, so the shard math lives once. At load
  ``TensorDeserializer.load_into_module`` calls ``register_parameter`` or ``register_buffer``
  by that type, so the type must be vLLM's: the attention scales (``_k_scale`` ...) are
  buffers, everything else is a parameter.
- ``vllm_tensorized_marker``: vLLM registers ``nn.Parameter(torch.tensor((1,),
  device="meta"))`` on the root module before serialising, so the file holds a PARAM named
  ``.vllm_tensorized_marker`` (root module name ``""``), int64, shape ``(1,)``, written hollow
  (no data bytes; tensorizer's file version 4). ``is_vllm_tensorized`` looks for exactly that
  key; without it vLLM treats the file as a whole Hugging Face checkpoint and calls
  ``load_weights``, which cannot take per-rank tensors.
- Tied embeddings: ``write_module`` visits ``model.embed_tokens`` and ``lm_head`` separately,
  and both hold the shared parameter, so both names are in vLLM's file (the sharded state
  keeps only ``lm_head.weight``); vLLM's loader fails on any state-dict tensor left on the meta
  device, so both are written here too.
- Not written: non-persistent buffers (the RoPE ``cos_sin_cache``). ``write_module`` includes
  them, but they are computed from ``config.json`` by the model's constructor, which vLLM runs
  before loading, and are not in ``state_dict()``; recomputing vLLM's rope variants here would
  only risk overwriting a correct cache with a wrong one. The file's module indexes number the
  modules that hold tensors in first-use order (vLLM counts every module);
  ``load_into_module`` resolves tensors by name and ignores the index.

**Streaming.** A tensorized file is a 256 KiB prologue (file header and metadata index),
then one record per tensor (a header holding the CRC32 and SHA-256 of the record, then the
data), then an 8-byte zero. tensorizer's own ``TensorSerializer`` takes whole tensors, seeks
and rewrites the prologue after each one; this writer instead writes each rank file once,
front to back, straight into its sink (a local file hashed as it is written, or an S3
multipart upload), with tensorizer's own codecs (``_TensorHeaderSerializer``,
``_FileHeader``): ``plan_writes`` fixes every record's header position and the prologue from
the plan (the prologue holds no hashes, only names, dtypes, shapes, offsets and sizes), and
the hashes are computed as the bytes stream by, through the same reader and per-rank scatter
as the ``sharded_state`` writer. As a record's hashes precede its data, a tensor's bytes must
all be seen before the first is written: small targets are gathered whole per rank; one
larger than ``HOLD_BYTES`` over the ranks (an MoE layer's expert stack, a large
vocabulary's head) is read twice, hashed, then written, so memory does not grow with the
model's largest tensor. ``tests/tensorizer`` holds the files byte for byte to what
``TensorSerializer`` writes for the same plan.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from modelstage.core.formats import FORMATS, Format
from modelstage.core.integrity import FileDigest
from modelstage.core.progress import Progress
from numpy.typing import NDArray

from ..checkpoint import Checkpoint
from ..destinations.base import Completed, Destination, OpenSink, Sink
from ..pieces import Piece, copy_piece, piece_nbytes
from ..shard_plan import TIED_EMBEDDING_TARGET, ShardPlan, TargetTensor
from .base import PlannedFile, WriteJob, Writer
from .rank_files import _DoneSink, _RankStreams, _stream_part

MARKER = ".vllm_tensorized_marker"
TIED_EMBEDDING_ALIASES = ("model.embed_tokens.weight",)
"""Where vLLM's module tree holds the tied head's parameter a second time."""
METADATA_BYTES = 256 * 1024
"""The metadata block tensorizer 2.10.1 reserves after its file header."""
HOLD_BYTES = 64 * 1024 * 1024
"""A target whose bytes over all the ranks being written fit in this is gathered whole in
memory; a larger one is read twice (``stream_ranks``)."""
HASH_SCRATCH_BYTES = 8 * 1024 * 1024

_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class Entry:
    """One tensor of a rank file: the label vLLM's ``write_module`` gives it and its type."""

    label: str
    module_idx: int
    buffer: bool
    """TensorType.BUFFER (else PARAM); must match vLLM's module or loading fails."""


def file_entries(plan: ShardPlan, tied: bool) -> dict[str, list[Entry]]:
    """{target name: its entries in the file}: one per target, two for a tied head."""
    modules: dict[str, int] = {"": 0}  # the root module holds the marker

    def entry(name: str, buffer: bool) -> Entry:
        module = name.rpartition(".")[0]
        idx = modules.setdefault(module, len(modules))
        return Entry(f"{module}.{name.rpartition('.')[2]}", idx, buffer)

    out: dict[str, list[Entry]] = {}
    for target in plan.targets:
        names = [target.name]
        if tied and target.name == TIED_EMBEDDING_TARGET:
            names = [*TIED_EMBEDDING_ALIASES, target.name]
        out[target.name] = [entry(n, target.constant is not None) for n in names]
    return out


def _numpy_dtype(dtype: Any, ndim: int) -> tuple[str, bool]:
    """tensorizer's dtype string for a torch dtype, and whether it is opaque (bfloat16)."""
    import torch
    from tensorizer._NumpyTensor import _NumpyTensor
    from tensorizer.serialization import OPAQUE_DTYPE_SEP

    numpy_tensor = _NumpyTensor.from_tensor(torch.empty((0,) * ndim, dtype=dtype))
    name = str(numpy_tensor.numpy_dtype)
    if numpy_tensor.is_opaque:
        name += OPAQUE_DTYPE_SEP + str(numpy_tensor.torch_dtype)
    return name, bool(numpy_tensor.is_opaque)


@dataclass(frozen=True)
class FileLayout:
    """What a rank file will hold before any tensor is written: its prologue's final bytes
    (file header + metadata index) and its size. Equal for every rank (equal shapes)."""

    prologue: bytes
    size: int


@dataclass(frozen=True)
class TensorWrite:
    """One tensor record of a rank file: where its header starts and what it describes.
    Equal for every rank; only the hashes in the header differ between ranks."""

    target: TargetTensor | None
    """None: the hollow marker."""
    module_idx: int
    label: str
    buffer: bool
    dtype: str
    """tensorizer's dtype string."""
    shape: tuple[int, ...]
    nbytes: int
    pos: int

    def header(self) -> Any:
        """A fresh ``_TensorHeaderSerializer`` of this record, its hash fields still empty."""
        from tensorizer.serialization import TensorType, _TensorHeaderSerializer

        kind = TensorType.BUFFER if self.buffer else TensorType.PARAM
        return _TensorHeaderSerializer(
            self.module_idx,
            kind,
            self.label.encode("utf-8"),
            self.dtype.encode("utf-8"),
            self.shape,
            self.nbytes,
            self.pos,
            include_crc32=True,
            include_sha256=True,
            crypt_info=None,
        )


def plan_writes(
    plan: ShardPlan, entries: dict[str, list[Entry]]
) -> tuple[list[TensorWrite], FileLayout]:
    """Every tensor record of a rank file in order (the marker, then the plan's targets) and
    the file's prologue and size, computed with tensorizer 2.10.1's own header codecs
    (``_TensorHeaderSerializer``, ``_FileHeader``) and version rules: the bytes its
    ``TensorSerializer`` writes for the same tensors (``tests/tensorizer`` compares them)."""
    import torch
    from tensorizer.serialization import (
        META_TENSOR_TENSORIZER_VERSION,
        NON_OPAQUE_TENSORIZER_VERSION,
        OPAQUE_TENSORIZER_VERSION,
        TENSORIZER_MAGIC,
        _FileFeatureFlags,
        _FileHeader,
    )

    version = NON_OPAQUE_TENSORIZER_VERSION
    start = len(TENSORIZER_MAGIC) + len(_FileHeader(version, _FileFeatureFlags(0), 0, 0).to_bytes())
    pos = start + 8 + METADATA_BYTES
    metadata = bytearray(METADATA_BYTES)
    cursor = tensor_bytes = 0
    # the marker is a meta tensor, written hollow (no data bytes): file version 4
    version = max(version, META_TENSOR_TENSORIZER_VERSION)
    todo: list[tuple[TargetTensor | None, Entry, Any, tuple[int, ...], int]] = [
        (None, Entry(MARKER, 0, False), torch.int64, (1,), 0)
    ]
    for target in plan.targets:
        dtype = getattr(torch, _TORCH_DTYPES[target.dtype])
        for e in entries[target.name]:
            todo.append((target, e, dtype, tuple(target.shape), target.nbytes))
    writes = []
    for owner, e, dtype, shape, nbytes in todo:
        name, opaque = _numpy_dtype(dtype, len(shape))
        if opaque:
            version = max(version, OPAQUE_TENSORIZER_VERSION)
        write = TensorWrite(owner, e.module_idx, e.label, e.buffer, name, shape, nbytes, pos)
        header = write.header()
        entry = header.metadata_entry
        if cursor + len(entry) > METADATA_BYTES:
            raise AssertionError("tensorizer's metadata block cannot index this many tensors")
        metadata[cursor : cursor + len(entry)] = entry
        cursor += len(entry)
        writes.append(write)
        pos += header.data_offset + nbytes
        tensor_bytes += nbytes
    file_header = _FileHeader(version, _FileFeatureFlags(0), tensor_bytes, len(todo)).to_bytes()
    prologue = TENSORIZER_MAGIC + file_header + struct.pack("<Q", METADATA_BYTES) + metadata
    assert len(prologue) == start + 8 + METADATA_BYTES
    return writes, FileLayout(bytes(prologue), pos + 8)  # + the zero length field at the end


def predict_layout(plan: ShardPlan, entries: dict[str, list[Entry]]) -> FileLayout:
    """A rank file's prologue and size (``plan_writes``)."""
    return plan_writes(plan, entries)[1]


class _Hashes:
    """tensorizer's two hashes of one tensor record, fed as its data streams by: CRC32 and
    SHA-256 over the header (hash fields empty) and then the data, as ``TensorSerializer``
    computes them."""

    def __init__(self, write: TensorWrite) -> None:
        self.header = write.header()
        self.crc32: int = self.header.compute_crc32()
        self.sha256 = self.header.compute_sha256()

    def update(self, data: Any) -> None:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.sha256.update(data)

    def header_bytes(self) -> bytes:
        """The header with both hashes filled in; feed no more data after this."""
        self.header.add_crc32(self.crc32)
        self.header.add_sha256(self.sha256.digest())
        return bytes(self.header.buffer)


class _Counted:
    """A rank's sink that counts what went in, to check the planned size at the end."""

    def __init__(self, sink: Sink) -> None:
        self.sink, self.nbytes = sink, 0

    def write(self, data: Piece) -> None:
        self.sink.write(data)
        self.nbytes += piece_nbytes(data)


class _Gather:
    """A rank's sink for small targets: gathers each target whole (``HOLD_BYTES`` bounds
    them), then writes its records (header with the hashes, then the data)."""

    def __init__(
        self, out: _Counted, targets: list[TargetTensor], writes: dict[str, list[TensorWrite]]
    ) -> None:
        self.out, self.writes = out, writes
        self.targets: Iterator[TargetTensor] = iter(targets)
        self.current: TargetTensor | None = None
        self.buf = np.empty(0, dtype=np.uint8)
        self.filled = 0
        self._next()

    def _next(self) -> None:
        """Advance to the next target, emitting any that need no bytes (empty tensors)."""
        self.current = next(self.targets, None)
        self.buf = np.empty(self.current.nbytes if self.current else 0, dtype=np.uint8)
        self.filled = 0
        if self.current is not None and self.current.nbytes == 0:
            self._emit()

    def write(self, data: Piece) -> None:
        done, total = 0, piece_nbytes(data)
        while done < total:
            if self.current is None:
                raise AssertionError("more bytes than the plan's tensors hold")
            n = copy_piece(data, done, self.buf[self.filled :])
            self.filled += n
            done += n
            if self.filled == self.buf.size:
                self._emit()

    def _emit(self) -> None:
        assert self.current is not None
        for write in self.writes[self.current.name]:
            hashes = _Hashes(write)
            hashes.update(self.buf)
            self.out.write(memoryview(hashes.header_bytes()))
            if self.buf.size:
                self.out.write(self.buf.data)
        self._next()

    def close(self) -> FileDigest:
        if self.current is not None:
            raise AssertionError(f"stream ended inside {self.current.name}")
        return FileDigest(0, 1, ())

    def abort(self) -> None:
        pass


class _Hasher:
    """A rank's sink for the first pass over a large target: only its records' hashes."""

    def __init__(self, writes: list[TensorWrite]) -> None:
        self.hashes = [_Hashes(w) for w in writes]
        self.scratch: NDArray[np.uint8] | None = None

    def write(self, data: Piece) -> None:
        if isinstance(data, memoryview):
            for h in self.hashes:
                h.update(data)
            return
        if self.scratch is None:
            self.scratch = np.empty(HASH_SCRATCH_BYTES, dtype=np.uint8)
        done, total = 0, piece_nbytes(data)
        while done < total:
            n = copy_piece(data, done, self.scratch)
            for h in self.hashes:
                h.update(self.scratch[:n])
            done += n

    def close(self) -> FileDigest:
        return FileDigest(0, 1, ())

    def abort(self) -> None:
        pass


class _Forward:
    """A rank's sink for the data pass over a large target: every piece straight on."""

    def __init__(self, out: _Counted) -> None:
        self.out = out

    def write(self, data: Piece) -> None:
        self.out.write(data)

    def close(self) -> FileDigest:
        return FileDigest(0, 1, ())

    def abort(self) -> None:
        pass


class _Quiet(Progress):
    """Progress of a pass whose bytes another pass counts."""

    def __init__(self) -> None:
        super().__init__(0, 0, label="", stream=io.StringIO())

    def advance(self, nbytes: int) -> None:
        pass

    def tensor_done(self) -> None:
        pass


class _Passes:
    """Streams targets from the checkpoint into one sink per rank, made for each pass."""

    def __init__(self, checkpoint: Checkpoint, outs: list[_Counted | None]) -> None:
        self.checkpoint, self.outs = checkpoint, outs

    def run(
        self, targets: list[TargetTensor], make: Callable[[_Counted], Sink], progress: Progress
    ) -> list[Sink]:
        sinks = [make(o) if o is not None else _DoneSink(FileDigest(0, 1, ())) for o in self.outs]
        with _RankStreams(sinks) as streams:
            _stream_part(targets, self.checkpoint, streams, progress)
        for s in sinks:
            s.close()
        return sinks

    def write_all(self, data: bytes | list[bytes]) -> None:
        """The same bytes into every rank's file, or ``data[rank]``."""
        for rank, out in enumerate(self.outs):
            if out is not None:
                out.write(memoryview(data if isinstance(data, bytes) else data[rank]))


def _write_large(
    passes: _Passes, target: TargetTensor, records: list[TensorWrite], progress: Progress
) -> None:
    """A target too large to hold: one pass to hash it, then one per record to write it."""
    hashers = passes.run([target], lambda _o: _Hasher(records), _Quiet())
    for i in range(len(records)):
        passes.write_all(
            [h.hashes[i].header_bytes() if isinstance(h, _Hasher) else b"" for h in hashers]
        )
        passes.run([target], _Forward, progress if i == 0 else _Quiet())


def stream_ranks(
    plan: ShardPlan,
    checkpoint: Checkpoint,
    sinks: Sequence[Sink | None],
    progress: Progress,
    *,
    tied: bool,
) -> None:
    """Write every rank's tensorized file into ``sinks[rank]``, front to back (a None sink:
    that rank is skipped); the sinks are left open.

    A record's header holds the CRC32 and SHA-256 of its data and comes before it, so a
    tensor's bytes must all be seen before the first of them is written. Targets whose bytes
    over the ranks being written fit in ``HOLD_BYTES`` are gathered whole in memory; a larger
    one (an MoE layer's stacked experts, a large vocabulary's embedding) is read from the
    source twice instead, once to hash it and once to write it, so memory stays bounded by
    the reader's buffers whatever the size of the model's largest tensor."""
    writes, layout = plan_writes(plan, file_entries(plan, tied))
    by_target: dict[str, list[TensorWrite]] = {}
    for w in writes[1:]:
        by_target.setdefault(w.target.name if w.target else "", []).append(w)
    outs = [_Counted(s) if s is not None else None for s in sinks]
    writing = max(1, sum(o is not None for o in outs))
    passes = _Passes(checkpoint, outs)
    passes.write_all(layout.prologue + _Hashes(writes[0]).header_bytes())  # + the marker
    held: list[TargetTensor] = []
    for target in [*plan.targets, None]:
        if target is not None and target.nbytes * writing <= HOLD_BYTES:
            held.append(target)
            continue
        if held:
            passes.run(
                held, functools.partial(_Gather, targets=list(held), writes=by_target), progress
            )
            held = []
        if target is not None:
            _write_large(passes, target, by_target[target.name], progress)
    passes.write_all(bytes(8))  # the zero length field that ends the file
    for out in outs:
        if out is not None and out.nbytes != layout.size:
            raise AssertionError(
                f"a tensorized rank file of {out.nbytes} bytes, {layout.size} were planned"
            )


class TensorizerWriter(Writer):
    """One tensorized file per rank, in vLLM's ``serialize_vllm_model`` layout."""

    def write(self, job: WriteJob, dest: Destination, progress: Progress) -> dict[str, FileDigest]:
        tied = job.checkpoint.model.tie_word_embeddings
        return write_tensorizer_files(
            job.plan,
            job.checkpoint,
            dest.open_sink,
            progress,
            dest.completed,
            tied=tied,
            fmt=job.format,
        )

    def planned(self, job: WriteJob) -> list[PlannedFile]:
        tied = job.checkpoint.model.tie_word_embeddings
        size = predict_layout(job.plan, file_entries(job.plan, tied)).size
        plan = job.plan
        return [
            PlannedFile(job.format.rank_file_name(r, 0, plan.pp_rank, plan.pp), size, r)
            for r in range(plan.tp)
        ]


def write_tensorizer_files(
    plan: ShardPlan,
    checkpoint: Checkpoint,
    open_sink: OpenSink,
    progress: Progress,
    completed: Completed | None = None,
    *,
    tied: bool,
    fmt: Format = FORMATS["tensorizer"],
) -> dict[str, FileDigest]:
    """Stream every rank's file (named by ``fmt``) into its sink; returns {file name: its
    digest}.
    ``completed`` skips a rank file an earlier run with the same run key finished
    (tensorizer's output is deterministic for the same plan): nothing is serialised for it."""
    layout = predict_layout(plan, file_entries(plan, tied))
    names = [fmt.rank_file_name(r, 0, plan.pp_rank, plan.pp) for r in range(plan.tp)]
    done = [completed(n, layout.size) if completed else None for n in names]
    results = {n: d for n, d in zip(names, done, strict=True) if d is not None}
    if len(results) == plan.tp:
        for _ in plan.targets:
            progress.tensor_done()
        return results
    sinks: list[Sink | None] = []
    try:
        for name, d in zip(names, done, strict=True):
            sinks.append(open_sink(name, layout.size) if d is None else None)
        stream_ranks(plan, checkpoint, sinks, progress, tied=tied)
        for name, sink in zip(names, sinks, strict=True):
            if sink is not None:
                results[name] = sink.close()
    except BaseException:
        for sink in sinks:
            if sink is not None:
                sink.abort()
        raise
    return dict(sorted(results.items()))
