"""The one small interface every writer implements, and what it is handed."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TextIO

from modelstage.core.formats import Format
from modelstage.core.integrity import FileDigest
from modelstage.core.layouts import Layout
from modelstage.core.progress import Progress

from ..checkpoint import Checkpoint
from ..destinations.base import Destination
from ..shard_plan import ShardPlan


@dataclass(frozen=True)
class WriteJob:
    """One artifact's weights to write: the checkpoint, its shard plan (the per-rank bytes;
    a copying writer ignores it), the layout and the format."""

    checkpoint: Checkpoint
    plan: ShardPlan
    layout: Layout
    format: Format


@dataclass(frozen=True)
class PlannedFile:
    """One file a writer would write, known before any byte is read (``modelstage plan``)."""

    name: str
    size: int
    rank: int | None
    """The tensor-parallel rank whose file it is; None for files every rank reads."""


class Writer(abc.ABC):
    """Writes one format's weight files through the destination's sinks. The stager then
    copies ``carried`` beside them and writes the manifest."""

    def progress(self, job: WriteJob, label: str, stream: TextIO | None = None) -> Progress:
        """What ``write`` reports its progress against: the checkpoint's tensor bytes."""
        return Progress(
            job.checkpoint.weight_bytes, len(job.plan.targets), label=label, stream=stream
        )

    @abc.abstractmethod
    def write(self, job: WriteJob, dest: Destination, progress: Progress) -> dict[str, FileDigest]:
        """Write the weight files into ``dest``; returns {file name: its digest}. Files an
        earlier run with the same run key finished (``Destination.completed``) are not written
        again."""

    def carried(self, checkpoint: Checkpoint) -> tuple[str, ...]:
        """The checkpoint's files copied whole beside the weights (config, tokenizer, ...)."""
        return checkpoint.carried_over

    @abc.abstractmethod
    def planned(self, job: WriteJob) -> list[PlannedFile]:
        """The weight files ``write`` would write, with their sizes, from the plan alone."""
