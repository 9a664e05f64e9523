"""vLLM's ``runai_streamer_sharded`` name, taken over by modelstage's reader (opt-in).

vLLM accepts ``--model s3://...`` only with its Run:ai format names, so a plugin format name
can never read an S3 artifact. With ``MODELSTAGE_S3_READER=1`` (set by the operator for S3
per-rank artifacts) ``register()`` puts this loader under ``runai_streamer_sharded``: the
same per-rank files and key semantics as the stock format, read by the pipelined reader with
8 ranged GETs in flight straight into the parameters (or pinned buffers), after the same
checks the local formats make (manifest, digest, TP, layout, sizes, headers; ETags pinned).
The Run:ai streamer spends about seven times the CPU per byte of plain ranged GETs
(docs/performance.md), which on a CPU-bound host caps its throughput at a third of them.
A local path under this name is read as ``modelstage_sharded_state`` reads it.
"""

from __future__ import annotations

from typing import ClassVar

from modelstage.core.formats import FORMATS, S3_READER_FORMAT

from .sharded_state import ModelstageShardedStateLoader


class ModelstageS3ShardedStateLoader(ModelstageShardedStateLoader):
    format = FORMATS[S3_READER_FORMAT]
    takes_stock_name: ClassVar[bool] = True
    reads_s3: ClassVar[bool] = True
