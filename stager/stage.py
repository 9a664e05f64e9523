"""``modelstage stage``: source -> shard plan -> rank files -> manifest, published atomically."""

from __future__ import annotations

import dataclasses
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
from .hf_layout import copy_weight_files, small_files
from .integrity import FileDigest
from .layouts import Layout, layout_for
from .manifest import FileEntry, Manifest
from .progress import Progress
from .rank_writer import write_rank_files
from .s3_client import S3Options
from .shard_plan import plan_shards
from .sources import Source, open_source

FORMATS = ("sharded_state", "runai_streamer_sharded", "runai_streamer", "tensorizer")
"""Formats this stager can write; ``tensorizer`` (one file per rank) is tensorizer_writer.py.

The format names the vLLM loader, the ``--out`` URI the destination: ``s3://`` is an S3
prefix, anything else a local directory (a mounted PVC). ``runai_streamer_sharded`` writes
the same per-rank files as ``sharded_state``; ``runai_streamer`` copies the Hugging Face
layout and lets vLLM split per rank at load. Both Run:ai formats load from S3 and from a
local directory. ``sharded_state`` to S3 is refused: vLLM's ShardedStateLoader reads local
directories only, and the same bytes on S3 are ``runai_streamer_sharded``.
"""
PER_RANK_FORMATS = ("sharded_state", "runai_streamer_sharded")


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
    s3: S3Options | None = None
    """How to reach ``s3://`` sources and destinations (endpoint, region, addressing, CA,
    credentials)."""
    hf_token_file: str | None = None
    """A mounted Secret holding a Hub token for ``hf://`` sources (default: ``HF_TOKEN``)."""
    cache_dir: str | None = None
    """The hub cache ``hf://`` sources download into (default: ``HF_HUB_CACHE``)."""
    max_part_bytes: int | None = None
    """Largest part file per rank (default: the layout's). It shapes the bytes: every
    worker and the finalize step of one artifact must use the same value."""
    allow_pickle: bool = False
    """Accept a checkpoint with only pickle weights, loaded with ``torch.load(weights_only=
    True)`` and converted to safetensors first (pickle_source.py); refused by default."""
    chunk_bytes: int | None = None
    """Chunk size of the files' content hashes (default ``integrity.DEFAULT_CHUNK_BYTES``)."""


def modelstage_version() -> str:
    try:
        return version("modelstage")
    except PackageNotFoundError:
        return "0+unknown"


def request_layout(req: StageRequest) -> Layout:
    """The layout to write, with the request's part size when it sets one."""
    layout = layout_for(req.vllm_version)
    if req.max_part_bytes is None:
        return layout
    if req.max_part_bytes < 1:
        raise SpecError(f"--max-part-bytes must be positive, not {req.max_part_bytes}")
    return dataclasses.replace(layout, max_part_bytes=req.max_part_bytes)


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


def open_destination(req: StageRequest) -> Destination:
    """The destination strategy for ``--out``: an S3 prefix or a local directory."""
    dest = _destination(req)
    if req.chunk_bytes is not None:
        if req.chunk_bytes < 1:
            raise SpecError(f"the hash chunk size must be positive, not {req.chunk_bytes}")
        dest.chunk_bytes = req.chunk_bytes
    return dest


def _destination(req: StageRequest) -> Destination:
    if req.out.startswith("s3://"):
        if req.format == "sharded_state":
            raise SpecError(
                "format sharded_state is read from local directories only; stage to S3 with "
                "--format runai_streamer_sharded (the same per-rank files) or runai_streamer"
            )
        from .destinations.s3 import S3Destination

        per_rank = req.format != "runai_streamer"  # every rank's file is open at once
        return S3Destination(req.out, req.s3, open_files=req.tp if per_rank else 1)
    if "://" in req.out and not req.out.startswith("file://"):
        raise SpecError(f"--out {req.out!r}: only s3:// URIs and local paths are supported")
    return LocalDestination(req.out.removeprefix("file://"))


def run_key(digest: str, identity: dict[str, Any]) -> str:
    """What pins the bytes a run writes: a rerun with the same key may reuse finished files."""
    canonical = json.dumps(
        {"digest": digest, "source": identity, "stager": modelstage_version()},
        sort_keys=True, separators=(",", ":"),
    )  # fmt: skip
    return hashlib.sha256(canonical.encode()).hexdigest()


def stage(req: StageRequest, *, progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Stage one artifact; returns the one-line summary. Idempotent for a complete artifact."""
    started = time.monotonic()
    if req.format not in FORMATS:
        raise SpecError(f"format {req.format!r} is not supported; supported: {', '.join(FORMATS)}")
    if req.pp != 1:
        raise SpecError("pipeline parallel size > 1 is not supported yet; use --pp 1")
    if req.format == "runai_streamer" and req.dtype != "auto":
        raise SpecError(
            "runai_streamer copies the checkpoint as it is; use --dtype auto (vLLM casts at "
            "load time with its own --dtype) or a per-rank format"
        )
    layout = request_layout(req)
    digest = request_digest(req)
    dest = open_destination(req)
    existing = dest.existing()
    if existing is not None:
        if existing.digest != digest:
            existing.check_expected(dest.uri, digest=digest)
        return _summary(existing, dest.uri, time.monotonic() - started, already=True)

    source = open_source(req.source, revision=req.revision, s3=req.s3,
                         hf_token_file=req.hf_token_file, cache_dir=req.cache_dir)  # fmt: skip
    if req.allow_pickle:
        source = _with_pickles_converted(source, req.out)
    try:
        checkpoint = open_checkpoint(source)
        # Also for runai_streamer: a TP that cannot split this model fails here, not in vLLM.
        plan = plan_shards(checkpoint.model, checkpoint.source_tensors, req.tp, layout, req.dtype)
        identity = checkpoint.identity()
        dest.begin(run_key(digest, identity))
        try:
            label = f"staging {req.format} tp={req.tp} to {dest.uri}"
            if req.format in PER_RANK_FORMATS:
                progress = Progress(checkpoint.weight_bytes, len(plan.targets), label=label,
                                    stream=progress_stream)  # fmt: skip
                files = write_rank_files(
                    plan, checkpoint, layout, dest.open_sink, progress, dest.completed
                )
                carried = checkpoint.carried_over
            elif req.format == "tensorizer":
                from .tensorizer_writer import spool_dir_for, write_tensorizer_files

                progress = Progress(checkpoint.weight_bytes, len(plan.targets), label=label,
                                    stream=progress_stream)  # fmt: skip
                files = write_tensorizer_files(
                    plan, checkpoint, dest.open_sink, progress, dest.completed,
                    tied=checkpoint.model.tie_word_embeddings, spool_dir=spool_dir_for(req.out),
                )  # fmt: skip
                carried = checkpoint.carried_over
            else:
                progress = Progress(
                    sum(source.size(f) for f in checkpoint.weight_files),
                    len(checkpoint.weight_files), label=label, stream=progress_stream,
                )  # fmt: skip
                files = copy_weight_files(checkpoint, dest.open_sink, progress, dest.completed)
                carried = small_files(checkpoint)
            for name in carried:
                files[name] = dest.write_small(name, source.read_bytes(name))
            progress.finish()
            manifest = build_manifest(req, digest, layout, identity, files, started)
            dest.commit(manifest)
        except BaseException:
            dest.abort()
            raise
    finally:
        source.close()
    return _summary(manifest, dest.uri, time.monotonic() - started, already=False)


def _with_pickles_converted(source: Source, out: str) -> Source:
    """``--allow-pickle``: a source without safetensors but with pickle weights is read
    through their safetensors conversion; any other source is returned as it is."""
    from .pickle_source import ConvertedPickleSource, pickle_weights, spool_dir_for

    files = source.list_files()
    if any(f.endswith(".safetensors") for f in files) or not pickle_weights(files):
        return source
    try:
        return ConvertedPickleSource(source, spool_dir_for(out))
    except BaseException:
        source.close()
        raise


def build_manifest(
    req: StageRequest,
    digest: str,
    layout: Layout,
    identity: dict[str, Any],
    files: dict[str, FileDigest],
    started: float,
) -> Manifest:
    """The manifest of a finished artifact: what it is, where it came from, every file."""
    return Manifest(
        format=req.format,
        tensorParallelSize=req.tp,
        pipelineParallelSize=req.pp,
        dtype=req.dtype,
        digest=digest,
        source={
            "uri": req.source_uri or open_source_uri(req.source),
            "revision": req.revision,
            **identity,
        },
        vllmVersion=layout.vllm_version,
        layoutVersion=layout.layout_version,
        files={n: FileEntry.of(d) for n, d in sorted(files.items())},
        bytes=sum(d.size for d in files.values()),
        modelstageVersion=modelstage_version(),
        createdAt=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        stageSeconds=round(time.monotonic() - started, 3),
    )


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
        "peakRssBytes": peak_rss_bytes(),
    }


def peak_rss_bytes() -> int:
    """This process's own peak RSS. ``/proc/self/status`` VmHWM counts only the memory since
    exec; ``ru_maxrss`` would also count the parent's, inherited at fork."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
