"""The ``runai_streamer`` and ``safetensors`` writer: the checkpoint's own Hugging Face
layout, copied as is, whatever its architecture or quantization.

vLLM's loaders (Run:ai's, the default one) split tensors per rank at load time with the
model's own ``load_weights``, so the artifact is the source's safetensors files, their index
and the files vLLM reads beside them (config, tokenizer, generation defaults), streamed through
the destination's sinks (multipart uploads for S3) in fixed-size chunks: memory stays bounded
whatever the file sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from modelstage.core.integrity import FileDigest
from modelstage.core.progress import Progress

from ..checkpoint import INDEX, Checkpoint
from ..destinations.base import Completed, Destination, OpenSink
from ..sources.base import Source
from .base import PlannedFile, WriteJob, Writer

COPY_CHUNK_BYTES = 8 * 1024 * 1024
INLINE_BYTES = 8 * 1024 * 1024
"""Carried files up to this size are read in one piece (``Destination.write_small``)."""


class HfCopyWriter(Writer):
    """The checkpoint's own safetensors files, byte for byte; its index travels with them."""

    def progress(self, job: WriteJob, label: str, stream: TextIO | None = None) -> Progress:
        files = job.checkpoint.weight_files
        total = sum(job.checkpoint.source.size(f) for f in files)
        return Progress(total, len(files), label=label, stream=stream, items="files")

    def write(self, job: WriteJob, dest: Destination, progress: Progress) -> dict[str, FileDigest]:
        return copy_weight_files(job.checkpoint, dest.open_sink, progress, dest.completed)

    def carried(self, checkpoint: Checkpoint) -> tuple[str, ...]:
        return small_files(checkpoint)

    def planned(self, job: WriteJob) -> list[PlannedFile]:
        source = job.checkpoint.source
        return [PlannedFile(n, source.size(n), None) for n in job.checkpoint.weight_files]


def copy_weight_files(
    checkpoint: Checkpoint,
    open_sink: OpenSink,
    progress: Progress,
    completed: Completed | None = None,
) -> dict[str, FileDigest]:
    """Copy every safetensors file byte for byte; returns {file name: its digest}.

    Small files (index, config, tokenizer) go through the destination's ``write_small``.
    """
    source = checkpoint.source
    results: dict[str, FileDigest] = {}
    buf = bytearray(COPY_CHUNK_BYTES)
    for name in checkpoint.weight_files:
        size = source.size(name)
        done = completed(name, size) if completed else None
        if done is not None:
            results[name] = done
            progress.tensor_done()
            continue
        results[name] = _stream(source, name, size, open_sink, buf, progress.advance)
        progress.tensor_done()
    return results


def _stream(
    source: Source,
    name: str,
    size: int,
    open_sink: OpenSink,
    buf: bytearray,
    advance: Callable[[int], None] | None = None,
) -> FileDigest:
    """Copy one file through a sink in ``buf``-sized chunks: memory stays at the buffer."""
    sink = open_sink(name, size)
    try:
        offset = 0
        while offset < size:
            n = min(len(buf), size - offset)
            view = memoryview(buf)[:n]
            source.read_range(name, offset, view)
            sink.write(view)  # sinks copy or write before returning: the buffer is reused
            if advance is not None:
                advance(n)
            offset += n
        return sink.close()
    except BaseException:
        sink.abort()
        raise


def copy_small_file(source: Source, name: str, dest: Destination) -> FileDigest:
    """One file carried beside the weights (config, tokenizer, index): in one piece when it
    is small (the destination may find it already there by its hash), streamed otherwise.
    Never read whole: its size is whatever the source says (``checkpoint`` caps it)."""
    size = source.size(name)
    if size <= INLINE_BYTES:
        return dest.write_small(name, source.read_bytes(name, max_bytes=INLINE_BYTES))
    done = dest.completed(name, size)
    if done is not None:
        return done
    return _stream(source, name, size, dest.open_sink, bytearray(COPY_CHUNK_BYTES))


def small_files(checkpoint: Checkpoint) -> tuple[str, ...]:
    """The files copied whole beside the weights: the index (when any) and the carried ones."""
    files = checkpoint.source.list_files()
    return ((INDEX,) if INDEX in files else ()) + checkpoint.carried_over
