"""Scale-out staging: ``stage --group i/n`` workers write parts, ``finalize`` publishes.

A large checkpoint is staged by n workers (the pods of an Indexed Job) that each write every
rank's files of some *parts*, then by one finalize step that checks every part and commits
the manifest. Why it is cut this way:

- **The part layout never depends on n.** ``writers.rank_files.plan_parts`` cuts parts at group
  boundaries (whole decoder layers; embeddings + final norm + head together) from the plan
  and the part size alone, and a worker writes whole parts, so the rank files of an n-way
  run are byte for byte those of a one-pod run. Cutting by source file instead would put
  a fused tensor (qkv, gate_up) into two part files, which vLLM refuses.
- **Workers take contiguous runs of parts, balanced by bytes** (``assign_parts``): a pure
  function of the part sizes and n, so every worker computes the same assignment without
  talking to the others. A worker reads only the byte ranges its parts need, from whatever
  source files hold them.
- **A shared work area, parts atomic.** Locally the workers share ``<out>.tmp-shared-<key>``
  (the key pins digest, source identity, stager version and part size); each part appears
  under its name only once fsynced, beside a sidecar with its size and chunk hashes. On S3
  the parts are objects under the prefix, each with its run key and content hash (root).
  Either way a rerun of a worker reuses the parts it finished, and nothing counts as an
  artifact before the manifest.
- **Finalize trusts nothing it has not checked.** It recomputes the expected part names and
  sizes from the plan, requires each part to be present, of this run and of that size, and
  re-hashes every part: local ones against their sidecars, S3 objects against the root
  their metadata records (``integrity.py``; chunks read in parallel, at the disk's or the
  network's pace); then it copies the small files,
  writes the manifest last and publishes (rename, or the manifest object).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

from modelstage.core.digest import identity_key
from modelstage.core.errors import SpecError
from modelstage.core.formats import FORMATS, Format, format_for
from modelstage.core.integrity import FileDigest
from modelstage.core.layouts import Layout
from modelstage.core.progress import Progress

from .checkpoint import Checkpoint, open_checkpoint
from .destinations.base import Destination
from .resolve import check_identity
from .shard_plan import ShardPlan, TargetTensor, plan_shards
from .stage import (
    StageRequest,
    _summary,
    aborted_on_failure,
    build_manifest,
    modelstage_version,
    open_run,
    request_destination,
    request_layout,
    run_key,
)
from .writers.hf_copy import copy_small_file
from .writers.rank_files import (
    part_sizes as part_sizes,
)
from .writers.rank_files import (
    plan_parts,
    rank_file_names,
    write_rank_files,
)

WORKERS_ENV = "MODELSTAGE_WORKERS"
INDEX_ENV = "JOB_COMPLETION_INDEX"
"""Set by Kubernetes in each pod of an Indexed Job."""
CHECK_THREADS = 4


@dataclass(frozen=True)
class Group:
    """Worker ``index`` of ``count`` (0-based)."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @staticmethod
    def parse(text: str) -> Group:
        index, sep, count = text.partition("/")
        try:
            group = Group(int(index), int(count))
        except ValueError:
            group = Group(-1, 0)
        if not sep or not 0 <= group.index < group.count:
            raise SpecError(f"--group {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
        return group

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Group | None:
        """The Indexed Job's contract: ``MODELSTAGE_WORKERS`` (set by the operator) and
        ``JOB_COMPLETION_INDEX`` (set by Kubernetes); None when not a worker pod."""
        if WORKERS_ENV not in env:
            return None
        if INDEX_ENV not in env:
            raise SpecError(f"{WORKERS_ENV} is set but {INDEX_ENV} is not: not an Indexed Job pod")
        return Group.parse(f"{env[INDEX_ENV]}/{env[WORKERS_ENV]}")


def assign_parts(sizes: Sequence[int], workers: int) -> list[range]:
    """Contiguous runs of part indices, one per worker, balanced by bytes.

    A part goes to the worker whose share of the total holds the part's middle byte; pure
    and deterministic, so every worker computes the same answer alone. Workers beyond the
    number of parts get an empty range (they finish at once).
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    total = max(sum(sizes), 1)
    owner, before = [], 0
    for size in sizes:
        owner.append(min(workers - 1, (2 * before + size) * workers // (2 * total)))
        before += size
    return [
        range(owner.index(w), len(owner) - owner[::-1].index(w)) if w in owner else range(0)
        for w in range(workers)
    ]


@dataclass
class _Run:
    checkpoint: Checkpoint
    plan: ShardPlan
    identity: dict[str, Any]
    layout: Layout
    format: Format
    key: str
    parts: list[list[TargetTensor]]
    params: dict[str, Any]
    """What the run key pins, in words (``Destination.begin_shared``)."""


def _check_request(req: StageRequest) -> None:
    if not format_for(req.format).scale_out:
        scaled = ", ".join(f.name for f in FORMATS.values() if f.scale_out)
        raise SpecError(
            f"format {req.format!r} has one writer per artifact; scale-out staging (--group, "
            f"finalize) applies to {scaled}"
        )
    if req.pp != 1:
        raise SpecError(
            f"scale-out staging (--group, finalize) stages pipeline parallel size 1 only; "
            f"stage --pp {req.pp} with one `modelstage stage`"
        )
    if req.force:
        raise SpecError(
            "--force replaces a whole artifact: use it with a one-pod `modelstage stage`, not "
            "with --group workers or finalize"
        )


def _plan_run(req: StageRequest, checkpoint: Checkpoint, digest: str, resolved: str) -> _Run:
    layout = request_layout(req)
    plan = plan_shards(checkpoint.model, checkpoint.source_tensors, req.tp, layout, req.dtype)
    identity = checkpoint.identity()
    check_identity(resolved, identity, req.source_uri or req.source)
    key = run_key(digest, {**identity, "maxPartBytes": layout.max_part_bytes})
    params = {
        "maxPartBytes": layout.max_part_bytes,
        "modelstageVersion": modelstage_version(),
        "source": identity_key(identity),
        "digest": digest,
    }
    parts = plan_parts(plan, layout.max_part_bytes)
    return _Run(checkpoint, plan, identity, layout, FORMATS[req.format], key, parts, params)


def stage_group(
    req: StageRequest, group: Group, *, progress_stream: TextIO | None = None
) -> dict[str, Any]:
    """Write every rank's files of this worker's parts into the shared work area."""
    started = time.monotonic()
    _check_request(req)
    dest = request_destination(req)
    opened = open_run(req, dest)
    if opened.existing is not None or opened.source is None:
        assert opened.existing is not None
        return {
            **_summary(opened.existing, dest, time.monotonic() - started, already=True),
            "group": str(group),
        }
    source = opened.source
    try:
        checkpoint = opened.resolved.checkpoint or open_checkpoint(source)
        run = _plan_run(req, checkpoint, opened.digest, opened.resolved.identity)
        mine = assign_parts(part_sizes(run.parts), group.count)[group.index]
        dest.begin_shared(run.key, params=run.params)
        with aborted_on_failure(dest):
            progress = Progress(
                sum(t.nbytes for p in mine for t in run.parts[p]) * run.plan.tp,
                sum(len(run.parts[p]) for p in mine),
                label=(
                    f"staging parts {mine.start}..{mine.stop - 1}" if mine else "no parts to stage"
                )
                + f" (group {group}) to {dest.uri}",
                stream=progress_stream,
            )
            files = write_rank_files(
                run.plan,
                run.checkpoint,
                run.layout,
                run.format,
                dest.open_sink,
                progress,
                dest.completed,
                only=mine,
            )
            progress.finish()
        dest.release()
    finally:
        source.close()
    return {
        "digest": opened.digest,
        "uri": dest.uri,
        "group": str(group),
        "parts": [mine.start, mine.stop] if mine else [],
        "files": len(files),
        "bytes": sum(d.size for d in files.values()),
        "seconds": round(time.monotonic() - started, 3),
        "alreadyStaged": False,
    }


def finalize(req: StageRequest, *, progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Check that every part of every rank is there and whole, then publish the artifact."""
    started = time.monotonic()
    _check_request(req)
    dest = request_destination(req)
    opened = open_run(req, dest)
    if opened.existing is not None or opened.source is None:
        assert opened.existing is not None
        return _summary(opened.existing, dest, time.monotonic() - started, already=True)
    source = opened.source
    try:
        checkpoint = opened.resolved.checkpoint or open_checkpoint(source)
        run = _plan_run(req, checkpoint, opened.digest, opened.resolved.identity)
        dest.begin_shared(run.key, finalize=True, params=run.params)
        with aborted_on_failure(dest):
            files = _check_parts(dest, run, progress_stream)
            for name in run.checkpoint.carried_over:
                files[name] = copy_small_file(source, name, dest)
            manifest = build_manifest(req, opened.digest, run.layout, run.identity, files, started)
            dest.commit(manifest)
    finally:
        source.close()
    return _summary(manifest, dest, time.monotonic() - started, already=False)


def _check_parts(
    dest: Destination, run: _Run, progress_stream: TextIO | None = None
) -> dict[str, FileDigest]:
    """Every rank's every part, checked in parallel (locally: re-hashed, which takes minutes
    for a large artifact, so each checked part is reported); the first problem in file order
    wins."""
    names = rank_file_names(run.format, run.plan, len(run.parts))
    sizes = part_sizes(run.parts)
    wanted = [(names[r][p], sizes[p]) for r in range(run.plan.tp) for p in range(len(sizes))]
    progress = Progress(
        sum(s for _, s in wanted),
        len(wanted),
        label=f"checking parts of {dest.uri}",
        stream=progress_stream,
        items="parts",
    )

    def check(name: str, size: int) -> FileDigest:
        found = dest.check_part(name, size)
        progress.advance(size)
        progress.tensor_done()
        return found

    with ThreadPoolExecutor(min(CHECK_THREADS, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(check, name, size) for name, size in wanted]
        checked = {name: f.result() for (name, _), f in zip(wanted, futures, strict=True)}
    progress.finish()
    return checked
