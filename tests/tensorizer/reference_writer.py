"""The reference the tensorizer writer is held to: tensorizer's own ``TensorSerializer``
writing the same shard plan into real, seekable files (it reserves the prologue, writes each
whole tensor, computes its hashes in its own thread pools and seeks back to rewrite the
header and the metadata index). The stager's streaming writer must produce the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from modelstage.core.integrity import FileDigest
from modelstage.core.progress import Progress
from modelstage.stager.checkpoint import Checkpoint
from modelstage.stager.destinations.base import Sink
from modelstage.stager.pieces import Piece, copy_piece, piece_nbytes
from modelstage.stager.shard_plan import ShardPlan, TargetTensor
from modelstage.stager.writers.rank_files import _DoneSink, _RankStreams, _stream_part
from modelstage.stager.writers.tensorizer import _TORCH_DTYPES, MARKER, Entry, file_entries


class _TensorCollector:
    """A rank's sink: gathers the streamed bytes of one target tensor at a time and hands
    each complete tensor to that rank's ``TensorSerializer`` (runs in the rank's thread)."""

    def __init__(
        self,
        serializer: Any,
        targets: list[TargetTensor],
        entries: dict[str, list[Entry]],
    ) -> None:
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
    files: Sequence[Any],
    progress: Progress,
    *,
    tied: bool,
) -> None:
    """Write every rank's tensorized file into ``files[rank]`` (a real, seekable file), or
    skip the rank where ``files[rank]`` is None; files are left closed."""
    import torch
    from tensorizer import TensorSerializer
    from tensorizer.serialization import TensorType

    entries = file_entries(plan, tied)
    serializers = [TensorSerializer(f) if f is not None else None for f in files]
    try:
        marker = torch.empty((1,), dtype=torch.int64, device="meta")
        sinks: list[Sink] = []
        for s in serializers:
            if s is None:
                sinks.append(_DoneSink(FileDigest(0, 1, ())))
                continue
            s.write_tensor(0, MARKER, TensorType.PARAM, marker)
            sinks.append(_TensorCollector(s, list(plan.targets), entries))
        with _RankStreams(sinks) as streams:
            _stream_part(list(plan.targets), checkpoint, streams, progress)
        for c in sinks:
            c.close()
    finally:
        _close_all(serializers, files)


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
            failure = failure or e
    if failure is not None:
        raise failure
