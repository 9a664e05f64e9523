"""Writers: a shard plan (or the checkpoint itself) -> the artifact's files, one per format.

Each writer implements ``base.Writer``; the format table names the one a format uses
(``Format.writer``) and ``writer_for`` looks it up. A new writer is a module here and a line in
``WRITERS``.
"""

from __future__ import annotations

from modelstage.core.formats import Format

from .base import PlannedFile, WriteJob, Writer
from .hf_copy import HfCopyWriter
from .rank_files import RankFilesWriter
from .tensorizer import TensorizerWriter

WRITERS: dict[str, Writer] = {
    "rank_files": RankFilesWriter(),
    "tensorizer": TensorizerWriter(),
    "hf_copy": HfCopyWriter(),
}

__all__ = ["WRITERS", "PlannedFile", "WriteJob", "Writer", "writer_for"]


def writer_for(fmt: Format) -> Writer:
    """The writer of ``fmt`` (the format table's ``writer``)."""
    return WRITERS[fmt.writer]
