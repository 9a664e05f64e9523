"""``modelstage stage``: source -> shard plan -> rank files -> manifest, published atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TextIO

from modelstage.core.digest import artifact_digest, identity_key
from modelstage.core.errors import ArtifactError, SpecError
from modelstage.core.formats import OCI, format_for
from modelstage.core.integrity import MAX_CHUNK_BYTES, FileDigest
from modelstage.core.layouts import Layout, layout_for
from modelstage.core.location import parse_location
from modelstage.core.manifest import FileEntry, Manifest
from modelstage.core.pipeline_parallel import spell_layer_partition

from .checkpoint import Checkpoint, open_checkpoint, plan_for
from .destinations import Destination, open_destination
from .request import StageRequest as StageRequest
from .resolve import Resolved, canonical_uri, check_expected, check_identity, resolve
from .shard_plan import Pipeline, ShardPlan
from .sources import Source, open_source
from .writers import WriteJob, writer_for
from .writers.hf_copy import copy_small_file


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


def request_pipeline(req: StageRequest) -> Pipeline:
    """The pipeline stages ``req`` stages for."""
    return Pipeline(req.pp, req.pp_partition)


def request_digest(req: StageRequest, identity: str) -> str:
    """The artifact digest of ``req`` for the resolved source ``identity``."""
    return req.digest or artifact_digest(
        uri=req.source_uri or canonical_uri(req.source),
        source=identity,
        tp=req.tp,
        pp=req.pp,
        dtype=req.dtype,
        load_format=req.format,
        layout_version=layout_for(req.vllm_version).layout_version,
        pp_partition=req.pp_partition,
    )


def request_destination(req: StageRequest) -> Destination:
    """Where ``req`` writes (``--out``), as its format allows, hashing in the request's chunk
    size when it sets one."""
    dest = open_destination(
        req.out, format_for(req.format), s3=req.s3, tp=req.tp, oci=req.oci,
        oci_form=req.oci_form, azure=req.azure,
    )  # fmt: skip
    if req.chunk_bytes is not None:
        if not 1 <= req.chunk_bytes <= MAX_CHUNK_BYTES:
            raise SpecError(
                f"the hash chunk size (--chunk-bytes) is {req.chunk_bytes}: it must be from 1 "
                f"to {MAX_CHUNK_BYTES} bytes (64Mi), the largest chunk a reader holds in memory"
            )
        dest.chunk_bytes = req.chunk_bytes
    return dest


def run_key(digest: str, identity: dict[str, Any]) -> str:
    """What pins the bytes a run writes: a rerun with the same key may reuse finished files."""
    canonical = json.dumps(
        {"digest": digest, "source": identity, "stager": modelstage_version()},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_request(req: StageRequest) -> None:
    """What refuses a request before any source is read (``modelstage plan`` shows it)."""
    fmt = format_for(req.format)
    if req.pp < 1 or req.tp < 1:
        raise SpecError(f"--tp {req.tp} --pp {req.pp}: parallel sizes are at least 1")
    fmt.check_pipeline(req.pp, layout_for(req.vllm_version))
    if req.pp_partition is not None and (req.pp == 1 or not fmt.per_rank):
        raise SpecError("--pp-layer-partition applies to per-rank formats with --pp greater than 1")
    if not fmt.casts and req.dtype != "auto":
        raise SpecError(
            f"{fmt.name} copies the checkpoint as it is; use --dtype auto (vLLM casts at "
            "load time with its own --dtype) or a per-rank format"
        )


def stage(req: StageRequest, *, progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Stage one artifact; returns the one-line summary. Idempotent for a complete artifact."""
    started = time.monotonic()
    check_request(req)
    fmt = format_for(req.format)
    layout = request_layout(req)
    dest = request_destination(req)
    run = open_run(req, dest)
    if run.existing is not None or run.source is None:
        assert run.existing is not None
        return _summary(run.existing, dest, time.monotonic() - started, already=True)
    source = _with_pickles_converted(run.source, req.out) if req.allow_pickle else run.source
    try:
        checkpoint = run.resolved.checkpoint or open_checkpoint(source)
        plans = plan_for(checkpoint, fmt, req.tp, layout, req.dtype, request_pipeline(req))
        identity = checkpoint.identity()
        check_identity(run.resolved.identity, identity, run.resolved.uri)
        dest.begin(run_key(run.digest, identity))
        with aborted_on_failure(dest):
            writer = writer_for(fmt)
            jobs = [WriteJob(checkpoint, plan, layout, fmt) for plan in plans]
            label = f"staging {req.format} tp={req.tp} pp={req.pp} to {dest.uri}"
            progress = writer.progress(jobs[0], label, progress_stream)
            later = sum(len(job.plan.targets) for job in jobs[1:])
            progress.add_total(_reread_bytes(checkpoint, plans), later)
            files: dict[str, FileDigest] = {}
            for job in jobs:
                files.update(writer.write(job, dest, progress))
            for name in writer.carried(checkpoint):
                files[name] = copy_small_file(source, name, dest)
            progress.finish()
            manifest = build_manifest(req, run.digest, layout, identity, files, started)
            dest.commit(manifest)
    finally:
        source.close()
    return _summary(manifest, dest, time.monotonic() - started, already=False)


def _reread_bytes(checkpoint: Checkpoint, plans: tuple[ShardPlan, ...]) -> int:
    """The source bytes read by more than one pipeline stage (the tensors outside the layers
    that several stages hold), read once per stage."""
    read: dict[str, int] = {}
    for plan in plans:
        for name in {s.source for t in plan.targets for s in t.slots if s.source is not None}:
            read[name] = read.get(name, 0) + 1
    return sum(checkpoint.tensors[n].nbytes * (count - 1) for n, count in read.items())


@dataclass
class OpenRun:
    """A run's start: its source resolved and checked, its digest, and either the artifact
    already there (nothing was opened) or the source opened to read."""

    resolved: Resolved
    digest: str
    existing: Manifest | None = None
    source: Source | None = None


def open_run(req: StageRequest, dest: Destination) -> OpenRun:
    """What ``stage``, ``stage --group`` and ``finalize`` start with: resolve the source and
    check it is the one expected, take the digest, look at the destination; then open the
    source (the one resolving opened, for a local or S3 source)."""
    resolved = resolve(req)
    try:
        check_expected(resolved, req.expect_identity)
        digest = request_digest(req, resolved.identity)
        existing = existing_artifact(dest, req, digest, resolved)
        if existing is not None:
            return OpenRun(resolved, digest, existing)
        source = resolved.source or open_source(
            req.source,
            revision=req.revision,
            s3=req.s3,
            azure=req.azure,
            oci=req.oci,
            hf_token_file=req.hf_token_file,
            cache_dir=req.cache_dir,
            timeouts=req.timeouts,
            commit=resolved.commit,
        )
        resolved.source = None  # handed on: the caller closes it
    finally:
        resolved.close()
    return OpenRun(resolved, digest, source=source)


@contextlib.contextmanager
def aborted_on_failure(dest: Destination) -> Iterator[None]:
    """Nothing of a failed (or interrupted) run stays visible: the work area goes."""
    try:
        yield
    except BaseException:
        dest.abort()
        raise


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
    if parse_location(dest.uri).kind == OCI:
        return None  # the new push's commit repoints the tag; the old image keeps its digest
    from .delete import remove_artifact

    remove_artifact(dest.uri, existing.digest, req.s3)
    return None


def _with_pickles_converted(source: Source, out: str) -> Source:
    """``--allow-pickle``: a source without safetensors but with pickle weights is read
    through their safetensors conversion; any other source is returned as it is."""
    from .sources.pickled import ConvertedPickleSource, pickle_weights, spool_dir_for

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
        pipelineLayerPartition=spell_layer_partition(req.pp_partition),
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


def _summary(
    manifest: Manifest, dest: Destination, seconds: float, *, already: bool
) -> dict[str, Any]:
    """The one-line JSON summary; ``address`` where the artifact is pinned by digest."""
    pinned = {"address": dest.address} if dest.address else {}
    return {
        "digest": manifest.digest,
        "uri": dest.uri,
        **pinned,
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
        "format": existing.format,
        "TP": existing.tensorParallelSize,
        "dtype": existing.dtype,
        "source": existing.source.get("uri"),
        "revision": existing.source.get("revision"),
        "layout": existing.layoutVersion,
        "source identity": existing.source.get("identity") or "not recorded",
    }
    ours = {
        "format": req.format,
        "TP": req.tp,
        "dtype": req.dtype,
        "source": source,
        "revision": req.revision,
        "layout": request_layout(req).layout_version,
        "source identity": identity,
    }
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
