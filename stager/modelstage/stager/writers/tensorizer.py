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

**Streaming.** The checkpoint is read once, through the same reader and per-rank scatter as
the ``sharded_state`` writer; each rank's bytes arrive in plan order and are collected one
target tensor at a time, handed to that rank's ``TensorSerializer.write_tensor`` and dropped:
memory holds one tensor per rank (the largest tensor of the model, split over the ranks), not
the model. tensorizer's writer seeks: it reserves a 256 KiB prologue (file header and
metadata index) up front and rewrites it after every tensor; everything after the prologue
it writes front to back, one tensor (header, then data) at a time. The prologue holds no
hashes, only names, dtypes, shapes, offsets and sizes, which the plan fixes, so
``predict_layout`` computes its final bytes (and the file's size) before the first tensor.
``_StreamingFile`` hands that prologue to the destination's sink first, then each tensor's
bytes as its ``write_tensor`` returns, and at ``close`` checks that what tensorizer wrote
into the prologue is exactly what was predicted (otherwise the file is refused and nothing
is published). Each rank file is thus written once, in order, straight into its sink (a
local file hashed as it is written, or an S3 multipart upload); nothing is spooled to disk.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from modelstage.core.formats import FORMATS, Format
from modelstage.core.integrity import FileDigest
from modelstage.core.progress import Progress

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
COPY_BELOW_BYTES = 1024 * 1024

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


class _TensorCollector:
    """A rank's sink: gathers the streamed bytes of one target tensor at a time and hands
    each complete tensor to that rank's ``TensorSerializer`` (runs in the rank's thread)."""

    def __init__(
        self,
        serializer: Any,
        targets: list[TargetTensor],
        entries: dict[str, list[Entry]],
        written: Any = None,
    ) -> None:
        self.serializer, self.entries = serializer, entries
        self.written = written
        """Called after each ``write_tensor`` (``_StreamingFile.commit``): the tensor is
        final in the file and its bytes may go on to the sink."""
        self.targets: Iterator[TargetTensor] = iter(targets)
        self.current: TargetTensor | None = None
        self.buf = bytearray()
        self.filled = 0
        self._next()

    def _next(self) -> None:
        """Advance to the next target, emitting any that need no bytes (empty tensors)."""
        self.current = next(self.targets, None)
        self.buf = bytearray(self.current.nbytes if self.current else 0)
        self.filled = 0
        if self.current is not None and self.current.nbytes == 0:
            self._emit()

    def write(self, data: Piece) -> None:
        done, total = 0, piece_nbytes(data)
        while done < total:
            if self.current is None:
                raise AssertionError("more bytes than the plan's tensors hold")
            space = np.frombuffer(self.buf, dtype=np.uint8)[self.filled :]
            n = copy_piece(data, done, space)
            del space  # the buffer is handed on whole once filled
            self.filled += n
            done += n
            if self.filled == len(self.buf):
                self._emit()

    def _emit(self) -> None:
        import torch
        from tensorizer.serialization import TensorType

        target = self.current
        assert target is not None
        dtype = getattr(torch, _TORCH_DTYPES[target.dtype])
        if target.nbytes:
            tensor = torch.frombuffer(self.buf, dtype=dtype).reshape(target.shape)
        else:
            tensor = torch.empty(target.shape, dtype=dtype)
        for e in self.entries[target.name]:
            kind = TensorType.BUFFER if e.buffer else TensorType.PARAM
            self.serializer.write_tensor(e.module_idx, e.label, kind, tensor)
            if self.written is not None:
                self.written()
        self._next()

    def close(self) -> FileDigest:
        if self.current is not None:
            raise AssertionError(f"stream ended inside {self.current.name}")
        return FileDigest(0, 1, ())

    def abort(self) -> None:
        pass


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


def predict_layout(plan: ShardPlan, entries: dict[str, list[Entry]]) -> FileLayout:
    """The bytes tensorizer 2.10.1's ``TensorSerializer`` leaves in the prologue after the
    marker and every entry were written in plan order, computed with its own header codecs
    (``_TensorHeaderSerializer``, ``_FileHeader``) and version rules. ``_StreamingFile``
    checks the prediction against what the serializer wrote, so a drift fails loudly."""
    import torch
    from tensorizer.serialization import (
        META_TENSOR_TENSORIZER_VERSION,
        NON_OPAQUE_TENSORIZER_VERSION,
        OPAQUE_TENSORIZER_VERSION,
        TENSORIZER_MAGIC,
        TensorType,
        _FileFeatureFlags,
        _FileHeader,
        _TensorHeaderSerializer,
    )

    writes: list[tuple[int, str, TensorType, Any, tuple[int, ...], int]] = [
        (0, MARKER, TensorType.PARAM, torch.int64, (1,), -1)  # hollow: no data bytes
    ]
    for target in plan.targets:
        dtype = getattr(torch, _TORCH_DTYPES[target.dtype])
        for e in entries[target.name]:
            kind = TensorType.BUFFER if e.buffer else TensorType.PARAM
            writes.append((e.module_idx, e.label, kind, dtype, tuple(target.shape), target.nbytes))
    version = NON_OPAQUE_TENSORIZER_VERSION
    start = len(TENSORIZER_MAGIC) + len(_FileHeader(version, _FileFeatureFlags(0), 0, 0).to_bytes())
    pos = start + 8 + METADATA_BYTES
    metadata = bytearray(METADATA_BYTES)
    cursor = tensor_bytes = 0
    for idx, label, kind, dtype, shape, nbytes in writes:
        if nbytes < 0:  # a meta tensor: written hollow, which needs file version 4
            version = max(version, META_TENSOR_TENSORIZER_VERSION)
            nbytes = 0
        name, opaque = _numpy_dtype(dtype, len(shape))
        if opaque:
            version = max(version, OPAQUE_TENSORIZER_VERSION)
        header = _TensorHeaderSerializer(
            idx,
            kind,
            label.encode("utf-8"),
            name.encode("utf-8"),
            shape,
            nbytes,
            pos,
            include_crc32=True,
            include_sha256=True,
            crypt_info=None,
        )
        entry = header.metadata_entry
        if cursor + len(entry) > METADATA_BYTES:
            raise AssertionError("tensorizer's metadata block cannot index this many tensors")
        metadata[cursor : cursor + len(entry)] = entry
        cursor += len(entry)
        pos += header.data_offset + nbytes
        tensor_bytes += nbytes
    file_header = _FileHeader(version, _FileFeatureFlags(0), tensor_bytes, len(writes)).to_bytes()
    prologue = TENSORIZER_MAGIC + file_header + struct.pack("<Q", METADATA_BYTES) + metadata
    assert len(prologue) == start + 8 + METADATA_BYTES
    return FileLayout(bytes(prologue), pos + 8)  # + the zero length field that ends the file


class _StreamingFile:
    """The seekable file ``TensorSerializer`` wants, over an append-only sink.

    Writes into the prologue land in a shadow copy (checked at ``close`` against the
    prediction, which went to the sink first). Writes after it are kept, without a copy for
    tensor data, until ``commit`` (called after each ``write_tensor``: the tensor is then
    complete up to the file position) sends them to the sink in file order. The 8-byte zero
    length field tensorizer writes after the last tensor stays pending: the next tensor's
    header overwrites it, or ``close`` sends it. tensorizer never rewrites a committed byte
    after the prologue; if it did, that is an error, not a silent corruption.
    """

    def __init__(self, sink: Sink, layout: FileLayout) -> None:
        self.sink, self.layout = sink, layout
        self.shadow = bytearray(len(layout.prologue))
        self.pos = 0
        self.emitted = len(layout.prologue)
        self.pending: list[tuple[int, memoryview]] = []
        self.aborted = self.closed = False
        self._lock = threading.Lock()
        sink.write(memoryview(layout.prologue))

    # --- what TensorSerializer calls ---------------------------------------------------------
    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0:
            raise OSError("only absolute seeks are supported")
        self.pos = offset
        return offset

    def flush(self) -> None:
        pass

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        if self.aborted:
            return n
        start, end = self.pos, self.pos + n
        with self._lock:
            if end <= len(self.shadow):
                self.shadow[start:end] = view
            elif start >= self.emitted:
                # Tensor data is kept by reference: its buffer lives until the collector
                # moves on, which is after ``commit``. Anything small is copied.
                kept = view if n >= COPY_BELOW_BYTES else memoryview(bytes(view))
                self.pending.append((start, kept))
            else:
                raise AssertionError(
                    f"tensorizer rewrote bytes {start}..{end} already streamed "
                    f"(streamed up to {self.emitted})"
                )
        self.pos = end
        return n

    def close(self) -> None:
        """The serializer is done: send the rest, then check the prologue and the size.
        Once only: tensorizer's ``__del__`` closes the file a second time."""
        if self.aborted or self.closed:
            return
        self.closed = True
        self._send(max((o + len(v) for o, v in self.pending), default=self.emitted))
        if self.emitted != self.layout.size:
            raise AssertionError(
                f"tensorizer wrote {self.emitted} bytes, {self.layout.size} were predicted"
            )
        if bytes(self.shadow) != self.layout.prologue:
            first = next(
                i
                for i, (a, b) in enumerate(zip(self.shadow, self.layout.prologue, strict=True))
                if a != b
            )
            raise AssertionError(
                f"tensorizer's file prologue differs from the predicted one at byte {first}; "
                "the tensorizer version is not the one this writer was made for (2.10.1)"
            )

    # --- what the collector calls ------------------------------------------------------------
    def commit(self) -> None:
        """Every byte before the file position is final: send it to the sink."""
        self._send(self.pos)

    def abort(self) -> None:
        self.aborted = True
        self.pending.clear()

    def _send(self, upto: int) -> None:
        with self._lock:
            pending, self.pending = self.pending, []
        # A later write wins over an earlier one it covers (the next tensor's header over
        # the zero length field); what remains must tile [emitted, upto) exactly.
        live = [
            (o, v)
            for i, (o, v) in enumerate(pending)
            if not any(p <= o and o + len(v) <= p + len(w) for p, w in pending[i + 1 :])
        ]
        live.sort(key=lambda item: item[0])
        keep: list[tuple[int, memoryview]] = []
        for offset, view in live:
            if offset + len(view) > upto:
                keep.append((offset, view))
                continue
            if offset != self.emitted:
                raise AssertionError(
                    f"tensorizer left bytes {self.emitted}..{offset} unwritten or written twice"
                )
            if len(view):
                self.sink.write(view)
            self.emitted += len(view)
        with self._lock:
            self.pending = keep + self.pending


def serialize_ranks(
    plan: ShardPlan,
    checkpoint: Checkpoint,
    files: Sequence[Any],
    progress: Progress,
    *,
    tied: bool,
) -> None:
    """Write every rank's tensorized file into ``files[rank]`` (seekable; a ``_StreamingFile``
    or a real file), or skip the rank where ``files[rank]`` is None; files are left closed."""
    import torch
    from tensorizer import TensorSerializer
    from tensorizer.serialization import TensorType

    entries = file_entries(plan, tied)
    serializers = [TensorSerializer(f) if f is not None else None for f in files]
    try:
        marker = torch.empty((1,), dtype=torch.int64, device="meta")
        sinks: list[Sink] = []
        for s, f in zip(serializers, files, strict=True):
            if s is None:
                sinks.append(_DoneSink(FileDigest(0, 1, ())))
                continue
            s.write_tensor(0, MARKER, TensorType.PARAM, marker)
            commit = getattr(f, "commit", None)
            if commit is not None:
                commit()
            sinks.append(_TensorCollector(s, list(plan.targets), entries, commit))
        with _RankStreams(sinks) as streams:
            _stream_part(list(plan.targets), checkpoint, streams, progress)
        for c in sinks:
            c.close()
    except BaseException:
        _abort_all(files)
        raise
    finally:
        _close_all(serializers, files)


def _abort_all(files: Sequence[Any]) -> None:
    for f in files:
        if isinstance(f, _StreamingFile):
            f.abort()


def _close_all(serializers: Sequence[Any], files: Sequence[Any]) -> None:
    """Close every serializer (closing its file and stopping its thread pools), also when one
    of them fails its close: then the others' files are aborted first."""
    failure: BaseException | None = None
    for s in serializers:
        if s is None:
            continue
        try:
            s.close()
        except BaseException as e:
            _abort_all(files)
            failure = failure or e
    if failure is not None:
        raise failure


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
        return [PlannedFile(job.format.rank_file_name(r), size, r) for r in range(job.plan.tp)]


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
    names = [fmt.rank_file_name(r) for r in range(plan.tp)]
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
        files = [_StreamingFile(s, layout) if s is not None else None for s in sinks]
        serialize_ranks(plan, checkpoint, files, progress, tied=tied)
        for name, sink in zip(names, sinks, strict=True):
            if sink is not None:
                results[name] = sink.close()
    except BaseException:
        for sink in sinks:
            if sink is not None:
                sink.abort()
        raise
    return dict(sorted(results.items()))
