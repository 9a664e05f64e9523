"""``modelstage stage``: source -> shard plan -> rank files -> manifest, published atomically."""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TextIO

from .checkpoint import open_checkpoint
from .destinations.base import Destination
from .destinations.local import LocalDestination
from .digest import artifact_digest
from .errors import SpecError
from .layouts import layout_for
from .manifest import FileEntry, Manifest
from .progress import Progress
from .rank_writer import write_rank_files
from .shard_plan import plan_shards
from .sources import open_source

FORMATS = ("sharded_state",)
"""Formats this stager can write; S3 and tensorizer formats register here as they land."""


@dataclass(frozen=True)
class StageRequest:
    source: str
    out: str
    tp: int
    pp: int = 1
    dtype: str = "auto"
    format: str = "sharded_state"
    vllm_version: str | None = None
    digest: str | None = None
    """The operator passes its own (computed from the spec); the CLI computes it otherwise."""
    revision: str | None = None
    source_uri: str | None = None
    """The logical URI (e.g. ``pvc://claim/path``) when ``source`` is where it is mounted."""


def modelstage_version() -> str:
    try:
        return version("modelstage")
    except PackageNotFoundError:
        return "0+unknown"


def request_digest(req: StageRequest) -> str:
    return req.digest or artifact_digest(
        uri=req.source_uri or open_source_uri(req.source),
        revision=req.revision,
        tensor_parallel=req.tp,
        pipeline_parallel=req.pp,
        dtype=req.dtype,
        load_format=req.format,
        layout_version=layout_for(req.vllm_version).layout_version,
    )


def open_source_uri(source: str) -> str:
    """A canonical URI for digests: absolute paths for local sources."""
    if "://" in source and not source.startswith("file://"):
        return source
    from pathlib import Path

    return "file://" + str(Path(source.removeprefix("file://")).absolute())


def stage(req: StageRequest, *, progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Stage one artifact; returns the one-line summary. Idempotent for a complete artifact."""
    started = time.monotonic()
    if req.format not in FORMATS:
        raise SpecError(f"format {req.format!r} is not supported; supported: {', '.join(FORMATS)}")
    if req.pp != 1:
        raise SpecError("pipeline parallel size > 1 is not supported yet; use --pp 1")
    layout = layout_for(req.vllm_version)
    digest = request_digest(req)
    dest: Destination = LocalDestination(req.out)
    existing = dest.existing()
    if existing is not None:
        if existing.digest != digest:
            existing.check_expected(dest.uri, digest=digest)
        return _summary(existing, dest.uri, time.monotonic() - started, already=True)

    source = open_source(req.source)
    try:
        checkpoint = open_checkpoint(source)
        plan = plan_shards(checkpoint.model, checkpoint.source_tensors, req.tp, layout, req.dtype)
        dest.begin()
        try:
            progress = Progress(
                checkpoint.weight_bytes,
                len(plan.targets),
                label=f"staging {req.format} tp={req.tp}",
                stream=progress_stream,
            )
            files = write_rank_files(plan, checkpoint, layout, dest.open_sink, progress)
            for name in checkpoint.carried_over:
                files[name] = dest.write_small(name, source.read_bytes(name))
            progress.finish()
            manifest = Manifest(
                format=req.format,
                tensorParallelSize=req.tp,
                pipelineParallelSize=req.pp,
                dtype=req.dtype,
                digest=digest,
                source={"uri": req.source_uri or open_source_uri(req.source),
                        "revision": req.revision, **checkpoint.identity()},
                vllmVersion=layout.vllm_version,
                layoutVersion=layout.layout_version,
                files={n: FileEntry(size=s, sha256=h) for n, (s, h) in sorted(files.items())},
                bytes=sum(s for s, _ in files.values()),
                modelstageVersion=modelstage_version(),
                createdAt=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                stageSeconds=round(time.monotonic() - started, 3),
            )  # fmt: skip
            dest.commit(manifest)
        except BaseException:
            dest.abort()
            raise
    finally:
        source.close()
    return _summary(manifest, dest.uri, time.monotonic() - started, already=False)


def source_identity_digest(identity: dict[str, Any]) -> str:
    """A short, stable stand-in for a long identity (termination messages hold 4 KiB)."""
    if identity.get("commit"):
        return f"commit:{identity['commit']}"
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _summary(manifest: Manifest, uri: str, seconds: float, *, already: bool) -> dict[str, Any]:
    return {
        "digest": manifest.digest,
        "uri": uri,
        "format": manifest.format,
        "tensorParallelSize": manifest.tensorParallelSize,
        "source": manifest.source.get("uri"),
        "sourceIdentity": source_identity_digest(manifest.source),
        "bytes": manifest.bytes,
        "files": len(manifest.files),
        "seconds": round(seconds, 3),
        "alreadyStaged": already,
    }
