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
the model. tensorizer's writer must seek (it reserves its metadata block up front and rewrites
the file header at ``close``), so each rank file is serialised into a local spool file and
then streamed through the destination's sink (hashing it on the way), which is exactly what
tensorizer's own ``open_stream("s3://...", "wb")`` does (a ``NamedTemporaryFile`` uploaded by
boto3 on close) -- except that the upload uses this stager's S3 client: endpoint, path-style
addressing, CA bundle, credentials files, retries, content-hash and run-key metadata, resuming.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .checkpoint import Checkpoint
from .integrity import FileDigest
from .pieces import Piece, copy_piece, piece_nbytes
from .progress import Progress
from .rank_writer import Completed, OpenSink, _RankStreams, _stream_part
from .shard_plan import TIED_EMBEDDING_TARGET, ShardPlan, TargetTensor

RANK_FILE_PATTERN = "model-rank-{rank:03d}.tensors"
"""``tensorizer_uri`` for vLLM is ``<dir>/model-rank-%03d.tensors``: it formats ``% rank``."""
MARKER = ".vllm_tensorized_marker"
TIED_EMBEDDING_ALIASES = ("model.embed_tokens.weight",)
"""Where vLLM's module tree holds the tied head's parameter a second time."""
SPOOL_COPY_BYTES = 8 * 1024 * 1024

_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def rank_file_name(rank: int) -> str:
    return RANK_FILE_PATTERN.format(rank=rank)


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

    def __init__(self, serializer: Any, targets: list[TargetTensor],
                 entries: dict[str, list[Entry]]) -> None:  # fmt: skip
        self.serializer, self.entries = serializer, entries
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
        self._next()

    def close(self) -> FileDigest:
        if self.current is not None:
            raise AssertionError(f"stream ended inside {self.current.name}")
        return FileDigest(0, 1, ())

    def abort(self) -> None:
        pass


def serialize_ranks(
    plan: ShardPlan,
    checkpoint: Checkpoint,
    files: Sequence[IO[bytes]],
    progress: Progress,
    *,
    tied: bool,
) -> None:
    """Write every rank's tensorized file into ``files[rank]`` (seekable, left closed)."""
    import torch
    from tensorizer import TensorSerializer
    from tensorizer.serialization import TensorType

    entries = file_entries(plan, tied)
    serializers = [TensorSerializer(f) for f in files]
    try:
        marker = torch.empty((1,), dtype=torch.int64, device="meta")
        for s in serializers:
            s.write_tensor(0, MARKER, TensorType.PARAM, marker)
        collectors = [_TensorCollector(s, list(plan.targets), entries) for s in serializers]
        with _RankStreams(collectors) as streams:
            _stream_part(list(plan.targets), checkpoint, streams, progress)
        for c in collectors:
            c.close()
    finally:
        for s in serializers:
            s.close()  # closes the file too; also on failure, to stop its thread pools


def write_tensorizer_files(
    plan: ShardPlan,
    checkpoint: Checkpoint,
    open_sink: OpenSink,
    progress: Progress,
    completed: Completed | None = None,
    *,
    tied: bool,
    spool_dir: Path,
) -> dict[str, FileDigest]:
    """Serialise every rank into ``spool_dir``, then stream each file into its sink; returns
    {file name: its digest}. ``completed`` skips the upload of a file an earlier run with
    the same run key finished (tensorizer's output is deterministic for the same plan).
    ``spool_dir`` is removed afterwards, also on failure."""
    spool_dir.mkdir(parents=True, exist_ok=True)
    try:
        paths = [spool_dir / rank_file_name(r) for r in range(plan.tp)]
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(open(p, "wb+")) for p in paths]
            serialize_ranks(plan, checkpoint, files, progress, tied=tied)
        results: dict[str, FileDigest] = {}
        for rank, path in enumerate(paths):
            name, size = rank_file_name(rank), path.stat().st_size
            done = completed(name, size) if completed else None
            results[name] = done if done is not None else _copy_into(path, open_sink(name, size))
            path.unlink()
        return results
    finally:
        shutil.rmtree(spool_dir, ignore_errors=True)


def _copy_into(path: Path, sink: Any) -> FileDigest:
    buf = bytearray(SPOOL_COPY_BYTES)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                sink.write(memoryview(buf)[:n])  # sinks copy or write before returning
        result: FileDigest = sink.close()
        return result
    except BaseException:
        sink.abort()
        raise


def spool_dir_for(out: str) -> Path:
    """A private spool directory: beside a local ``--out`` (same filesystem, and named so
    that the local destination's ``begin`` removes it after a crash), else in TMPDIR."""
    if out.startswith("s3://"):
        return Path(tempfile.mkdtemp(prefix="modelstage-tensorizer-"))
    local = Path(out.removeprefix("file://")).absolute()
    local.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{local.name}.tmp-tensorizer-", dir=local.parent))
