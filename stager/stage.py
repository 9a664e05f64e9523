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
from .digest import artifact_digest, identity_key
from .errors import ArtifactError, SpecError
from .hf_layout import copy_small_file, copy_weight_files, small_files
from .integrity import FileDigest
from .layouts import Layout, layout_for
from .manifest import FileEntry, Manifest
from .network import Timeouts
from .progress import Progress
from .rank_writer import write_rank_files
from .resolve import Resolved, canonical_uri, check_expected, check_identity, resolve
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
    """The operator passes its own (computed from the spec and the resolved source identity);
    the CLI computes it otherwise."""
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
    timeouts: Timeouts | None = None
    """Connect/read timeouts and retries of Hub requests (default: ``MODELSTAGE_*`` or
    network.py's defaults); S3 takes its own from ``s3``."""
    max_part_bytes: int | None = None
    """Largest part file per rank (default: the layout's). It shapes the bytes: every
    worker and the finalize step of one artifact must use the same value."""
    allow_pickle: bool = False
    """Accept a checkpoint with only pickle weights, loaded with ``torch.load(weights_only=
    True)`` and converted to safetensors first (pickle_source.py); refused by default."""
    expect_identity: str | None = None
    """The source identity resolved earlier (the operator's resolve step): a source that no
    longer has it is refused instead of staged under a digest that does not describe it."""
    force: bool = False
    """Replace an artifact already at ``out`` (another digest, or the same one re-staged)."""
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


def request_digest(req: StageRequest, identity: str) -> str:
    """The artifact digest of ``req`` for the resolved source ``identity``."""
    return req.digest or artifact_digest(
        uri=req.source_uri or canonical_uri(req.source),
        source=identity,
        tensor_parallel=req.tp,
        pipeline_parallel=req.pp,
        dtype=req.dtype,
        load_format=req.format,
        layout_version=layout_for(req.vllm_version).layout_version,
    )


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


def check_request(req: StageRequest) -> None:
    """What refuses a request before any source is read (``modelstage plan`` shows it)."""
    if req.format not in FORMATS:
        raise SpecError(f"format {req.format!r} is not supported; supported: {', '.join(FORMATS)}")
    if req.pp != 1:
        raise SpecError("pipeline parallel size > 1 is not supported yet; use --pp 1")
    if req.format == "runai_streamer" and req.dtype != "auto":
        raise SpecError(
            "runai_streamer copies the checkpoint as it is; use --dtype auto (vLLM casts at "
            "load time with its own --dtype) or a per-rank format"
        )


def stage(req: StageRequest, *, progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Stage one artifact; returns the one-line summary. Idempotent for a complete artifact."""
    started = time.monotonic()
    check_request(req)
    layout = request_layout(req)
    dest = open_destination(req)
    resolved = resolve(req)
    try:
        check_expected(resolved, req.expect_identity)
        digest = request_digest(req, resolved.identity)
        existing = existing_artifact(dest, req, digest, resolved)
        if existing is not None:
            return _summary(existing, dest.uri, time.monotonic() - started, already=True)
        source = resolved.source or open_source(req.source, revision=req.revision, s3=req.s3,
                                                hf_token_file=req.hf_token_file,
                                                cache_dir=req.cache_dir, timeouts=req.timeouts,
                                                commit=resolved.commit)  # fmt: skip
        resolved.source = None  # handed on: closed below, as ``source``
    finally:
        resolved.close()
    if req.allow_pickle:
        source = _with_pickles_converted(source, req.out)
    try:
        checkpoint = resolved.checkpoint or open_checkpoint(source)
        # Also for runai_streamer: a TP that cannot split this model fails here, not in vLLM.
        plan = plan_shards(checkpoint.model, checkpoint.source_tensors, req.tp, layout, req.dtype)
        identity = checkpoint.identity()
        check_identity(resolved.identity, identity, resolved.uri)
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
                from .tensorizer_writer import write_tensorizer_files

                progress = Progress(checkpoint.weight_bytes, len(plan.targets), label=label,
                                    stream=progress_stream)  # fmt: skip
                files = write_tensorizer_files(
                    plan, checkpoint, dest.open_sink, progress, dest.completed,
                    tied=checkpoint.model.tie_word_embeddings,
                )  # fmt: skip
                carried = checkpoint.carried_over
            else:
                progress = Progress(
                    sum(source.size(f) for f in checkpoint.weight_files),
                    len(checkpoint.weight_files), label=label, stream=progress_stream,
                    items="files",
                )  # fmt: skip
                files = copy_weight_files(checkpoint, dest.open_sink, progress, dest.completed)
                carried = small_files(checkpoint)
            for name in carried:
                files[name] = copy_small_file(source, name, dest)
            progress.finish()
            manifest = build_manifest(req, digest, layout, identity, files, started)
            dest.commit(manifest)
        except BaseException:
            dest.abort()
            raise
    finally:
        source.close()
    return _summary(manifest, dest.uri, time.monotonic() - started, already=False)


def existing_artifact(
    dest: Destination, req: StageRequest, digest: str, resolved: Resolved
) -> Manifest | None:
    """The artifact already at the destination when it is the one this run would write.

    One of another digest (the source changed since it was staged, or another request) is
    refused, saying what is there and what this run would write; ``--force`` deletes it
    (manifest first) and the run stages anew."""
    existing = dest.existing()
    if existing is None or (existing.digest == digest and not req.force):
        return existing
    if not req.force:
        raise occupied(existing, dest.uri, req, digest, resolved.identity)
    from .delete import remove_artifact

    remove_artifact(dest.uri, existing.digest, req.s3)
    return None


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
            "uri": req.source_uri or canonical_uri(req.source),
            "revision": req.revision,
            **identity,
            "identity": identity_key(identity),
        },
        vllmVersion=layout.vllm_version,
        layoutVersion=layout.layout_version,
        files={n: FileEntry.of(d) for n, d in sorted(files.items())},
        bytes=sum(d.size for d in files.values()),
        modelstageVersion=modelstage_version(),
        createdAt=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        stageSeconds=round(time.monotonic() - started, 3),
    )


def _summary(manifest: Manifest, uri: str, seconds: float, *, already: bool) -> dict[str, Any]:
    return {
        "digest": manifest.digest,
        "uri": uri,
        "format": manifest.format,
        "tensorParallelSize": manifest.tensorParallelSize,
        "source": manifest.source.get("uri"),
        "sourceIdentity": manifest.source.get("identity"),
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


def occupied(
    existing: Manifest, uri: str, req: StageRequest, digest: str, identity: str
) -> ArtifactError:
    """``--out`` holds another artifact: say what is there, what this run would write, and
    what differs (an artifact is never overwritten without ``--force``). ``identity``: the
    source identity this run resolved; a changed source differs only in it."""
    source = req.source_uri or canonical_uri(req.source)
    theirs = {
        "format": existing.format, "TP": existing.tensorParallelSize, "dtype": existing.dtype,
        "source": existing.source.get("uri"), "revision": existing.source.get("revision"),
        "layout": existing.layoutVersion,
        "source identity": existing.source.get("identity") or "not recorded",
    }  # fmt: skip
    ours = {
        "format": req.format, "TP": req.tp, "dtype": req.dtype, "source": source,
        "revision": req.revision, "layout": request_layout(req).layout_version,
        "source identity": identity,
    }  # fmt: skip
    differ = [k for k in ours if ours[k] != theirs[k]] or ["digest (--digest)"]
    changed = (
        " (the source changed since that artifact was staged)"
        if differ == ["source identity"]
        else ""
    )

    def describe(d: dict[str, Any]) -> str:
        at = f"@{d['revision']}" if d["revision"] else ""
        return (
            f"{d['format']}, TP {d['TP']}, dtype {d['dtype']}, from {d['source']}{at}, "
            f"source identity {d['source identity']}"
        )

    return ArtifactError(
        f"{uri} already holds artifact {existing.digest} ({describe(theirs)}, staged "
        f"{existing.createdAt}); this run would write artifact {digest} ({describe(ours)}); "
        f"they differ in {', '.join(differ)}{changed}. An artifact is never overwritten: "
        "choose another --out, pass --force to replace it, or delete the old one first "
        f"(`modelstage delete --artifact {uri}`)"
    )
