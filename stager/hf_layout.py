"""The ``runai_streamer`` writer: the checkpoint's own Hugging Face layout, copied as is.

vLLM's Run:ai loader splits tensors per rank at load time, so the artifact is the source's
safetensors files, their index and the files vLLM reads beside them (config, tokenizer,
generation defaults), streamed through the destination's sinks (multipart uploads for S3)
in fixed-size chunks: memory stays bounded whatever the file sizes.
"""

from __future__ import annotations

from .checkpoint import INDEX, Checkpoint
from .integrity import FileDigest
from .progress import Progress
from .rank_writer import Completed, OpenSink

COPY_CHUNK_BYTES = 8 * 1024 * 1024


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
        sink = open_sink(name, size)
        try:
            offset = 0
            while offset < size:
                n = min(len(buf), size - offset)
                view = memoryview(buf)[:n]
                source.read_range(name, offset, view)
                sink.write(view)  # sinks copy or write before returning: the buffer is reused
                progress.advance(n)
                offset += n
            results[name] = sink.close()
        except BaseException:
            sink.abort()
            raise
        progress.tensor_done()
    return results


def small_files(checkpoint: Checkpoint) -> tuple[str, ...]:
    """The files copied whole beside the weights: the index (when any) and the carried ones."""
    files = checkpoint.source.list_files()
    return ((INDEX,) if INDEX in files else ()) + checkpoint.carried_over
