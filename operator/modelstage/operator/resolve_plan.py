"""``spec + last resolution (+ the resolve Job) -> the source identity to stage from``.

A moving reference (a Hub branch, an S3 prefix whose objects can be replaced, a folder on a
claim that can be rewritten) names different bytes over time, so the artifact digest is taken
from the source's *resolved* identity, not from the spec's text. The operator never reads the
source (it holds no credentials and mounts no claims): a short Job in the stager image runs
``modelstage resolve`` with the stager Job's volumes, credentials and security context, and
its termination message carries the identity. It is recorded in ``status.source`` with the
time, and ``artifact.spec_digest(spec, identity)`` is the stager's own digest of it.

When a resolution is due:

- none is recorded for the spec's source fields (``source_key``: URI, revision, endpoint), so
  on creation and after each change of them;
- ``model.resolveIntervalSeconds`` (else the operator's default) has passed since the last one:
  a source that changed meanwhile gets a new digest, and is staged and rolled out like a spec
  change (the old artifact serves until the new one is staged). Checked at each
  reconciliation, so at least every ``MODELSTAGE_OPERATOR_RESYNC_INTERVAL``.

A pinned commit (``hf://`` with a 40-character sha as the revision) never moves: its identity is
known from the spec and no Job runs. Each round's Job has a deterministic name (owner, source
key, time of the previous resolution), so a restarted operator finds the Job it created; a
finished one removes itself after ``RESOLVE_TTL_SECONDS``, which is also how a failed one is
retried (or at once, by deleting it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from modelstage.api.modeldeployment import FormatStatus, ModelDeploymentSpec, SourceStatus
from modelstage.core.digest import IDENTITY_KEY, SOURCE_CHANGED
from modelstage.core.formats import AUTO, choose_format

from .artifact import spec_format
from .observations import JobObservation

HF_COMMIT = re.compile(r"^[0-9a-f]{40}$")
RESOLVE_TTL_SECONDS = 300
"""A finished resolve Job goes away after this long; a failed one is then retried."""
RESOLVE_JOB_PREFIX = "modelstage-resolve-"
MAX_NAME = 200
"""Architecture and quantization names are short; a longer report is cut for the status."""


def source_key(spec: ModelDeploymentSpec) -> str:
    """What a resolution is valid for: the source's URI, revision and S3 endpoint."""
    model = spec.model
    endpoint = None
    if model.scheme == "s3":
        connection = spec.storage.s3 or model.s3
        endpoint = connection.endpoint if connection is not None else None
    canonical = json.dumps(
        {"uri": model.uri.rstrip("/"), "revision": model.revision, "endpoint": endpoint},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def pinned_identity(spec: ModelDeploymentSpec) -> str | None:
    """The identity a spec names by itself: an hf:// source at a full commit sha (with
    ``loadFormat: auto`` the resolve Job still runs, to read the architecture)."""
    return None if spec.load_format == AUTO else _commit(spec)


def _commit(spec: ModelDeploymentSpec) -> str | None:
    revision = spec.model.revision
    if spec.model.scheme == "hf" and revision is not None and HF_COMMIT.fullmatch(revision):
        return f"commit:{revision}"
    return None


def _described(spec: ModelDeploymentSpec, recorded: SourceStatus) -> bool:
    """Whether ``recorded`` tells ``auto`` what it decides by (or the spec names a format)."""
    return spec.load_format != AUTO or recorded.architecture is not None


def chosen_format(spec: ModelDeploymentSpec, source: SourceStatus | None) -> FormatStatus | None:
    """The format the spec's artifact is staged in, and why: the spec's, or the one ``auto``
    picks by the architecture and quantization the resolve Job read (None until it has)."""
    if spec.load_format != AUTO:
        return FormatStatus(name=spec_format(spec), reason="set in spec.loadFormat")
    if source is None or source.key != source_key(spec) or source.architecture is None:
        return None
    storage = "s3" if spec.storage.s3 is not None else "pvc"
    choice = choose_format(
        storage, source.architecture or None, source.quantization, spec.serving.vllm_version
    )
    return FormatStatus.model_validate({"name": choice.format, "reason": choice.reason})


def concrete_spec(spec: ModelDeploymentSpec, chosen: FormatStatus) -> ModelDeploymentSpec:
    """``spec`` with ``loadFormat`` set to the chosen format: what every planner reads."""
    return spec.model_copy(update={"load_format": chosen.name})


def recorded_identity(spec: ModelDeploymentSpec, recorded: SourceStatus | None) -> str | None:
    """The identity the spec's artifact is staged from now, without a new resolution: the
    pinned commit, or the recorded one when it is for these source fields."""
    pinned = pinned_identity(spec)
    if pinned is not None:
        return pinned
    if recorded is not None and recorded.key == source_key(spec) and _described(spec, recorded):
        return recorded.identity
    return None


def resolve_job_name(spec: ModelDeploymentSpec, recorded: SourceStatus | None, owner: str) -> str:
    """This round's resolve Job: one per owner, source fields and previous resolution."""
    key = source_key(spec)
    after = recorded.resolved_at.isoformat() if recorded and recorded.key == key else ""
    seed = json.dumps([owner, key, after])
    return RESOLVE_JOB_PREFIX + hashlib.sha256(seed.encode()).hexdigest()[:20]


def parse_resolution(message: str) -> Mapping[str, Any] | None:
    """``modelstage resolve``'s one-line JSON (the last line), or None."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return None
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    if not isinstance(result, dict) or not IDENTITY_KEY.fullmatch(str(result.get("identity"))):
        return None
    return result


@dataclass(frozen=True)
class SourceStep:
    """Where the source's resolution stands, for ``state.decide``."""

    source: SourceStatus | None
    """The identity to stage from now (the recorded one while a new resolution runs); None
    while none is known for the spec's source fields."""
    state: Literal["resolved", "create", "resolving", "failed"]
    """``create``: the resolve Job ``job_name`` is to be created."""
    job_name: str = ""
    message: str = ""
    """What the resolve Job does or why it failed, for the conditions."""


def source_status(
    spec: ModelDeploymentSpec, identity: str, *, now: datetime, job: str | None = None
) -> SourceStatus:
    """The status record of ``identity`` resolved for ``spec`` at ``now`` (by ``job``)."""
    commit = identity.removeprefix("commit:") if identity.startswith("commit:") else None
    return SourceStatus(
        uri=spec.model.uri,
        revision=spec.model.revision,
        identity=identity,
        commit=commit,
        resolved_at=now,
        key=source_key(spec),
        job=job,
    )


def describe(spec: ModelDeploymentSpec) -> str:
    model = spec.model
    return f"{model.uri}@{model.revision}" if model.revision else model.uri


def resolution_due(
    spec: ModelDeploymentSpec,
    recorded: SourceStatus | None,
    *,
    now: datetime,
    interval: float,
    stale: bool = False,
) -> bool:
    """Whether a resolve Job is needed now: never for a pinned commit; when nothing is
    recorded for the spec's source fields; when ``interval`` seconds (> 0) have passed; when
    the recorded identity is ``stale`` (``source_changed``)."""
    if pinned_identity(spec) is not None:
        return False
    if recorded is None or recorded.key != source_key(spec) or stale:
        return True
    if not _described(spec, recorded):
        return True
    if _commit(spec) is not None:
        return False  # a commit never moves: read once, for auto
    return interval > 0 and now >= recorded.resolved_at + timedelta(seconds=interval)


_FOUND = re.compile(r"found (commit:[0-9a-f]{40}|sha256:[0-9a-f]{64})")


def source_changed(stage_job: JobObservation, recorded: SourceStatus | None) -> bool:
    """The stage Job refused its ``--expect-identity`` after the recorded resolution: the
    source changed between resolving and staging, to an identity other than the recorded one.
    Then it is resolved again at once (else it would stay ``StagingFailed`` until the next
    interval or spec change); once, not again after a resolution that found it unchanged."""
    if recorded is None or stage_job.state != "Failed" or SOURCE_CHANGED not in stage_job.message:
        return False
    if stage_job.finished_at is not None and stage_job.finished_at < recorded.resolved_at:
        return False
    found = _FOUND.search(stage_job.message)
    return found is None or found.group(1) != recorded.identity


def plan_source(
    spec: ModelDeploymentSpec,
    recorded: SourceStatus | None,
    *,
    owner: str,
    now: datetime,
    interval: float,
    job: JobObservation | None,
    stale: bool = False,
) -> SourceStep:
    """The resolution step. ``job`` is the observation of ``resolve_job_name(spec, recorded,
    owner)`` (None when it does not exist); ``interval``: seconds between resolutions of a
    moving reference, 0 for none; ``stale``: the recorded identity is known to be outdated."""
    key = source_key(spec)
    pinned = pinned_identity(spec)
    if pinned is not None:
        same = recorded is not None and recorded.key == key and recorded.identity == pinned
        at = recorded.resolved_at if same and recorded is not None else now
        return SourceStep(source_status(spec, pinned, now=at), "resolved")
    current = recorded if recorded is not None and recorded.key == key else None
    if current is not None and not _described(spec, current):
        current = None  # auto cannot choose a format from it: resolving, as for a new source
    if not resolution_due(spec, recorded, now=now, interval=interval, stale=stale):
        return SourceStep(current, "resolved")
    name = resolve_job_name(spec, recorded, owner)
    what = f"resolving the source identity of {describe(spec)}"
    if job is None:
        return SourceStep(current, "create", name, f"{what} (Job {name})")
    if job.state == "Failed":
        reason = job.message.strip().splitlines()[-1] if job.message.strip() else "it failed"
        return SourceStep(
            current,
            "failed",
            name,
            f"resolving {describe(spec)} failed: {reason} (Job {name}; retried when the Job "
            f"is gone, after {RESOLVE_TTL_SECONDS} s or when deleted)",
        )
    result = parse_resolution(job.message) if job.state == "Succeeded" else None
    if result is None:  # running, or done with its termination message not yet seen
        return SourceStep(current, "resolving", name, f"{what} (Job {name})")
    found_commit = result.get("commit")
    quantization = result.get("quantization")
    resolved = SourceStatus(
        uri=spec.model.uri,
        revision=spec.model.revision,
        identity=str(result["identity"]),
        commit=str(found_commit) if found_commit else None,
        resolved_at=now,  # the operator's clock: the interval is measured on it
        key=key,
        job=name,
        # "" when it names none (or an older stager did not say): auto then caches the
        # Hugging Face layout, which vLLM loads for any architecture.
        architecture=str(result.get("architecture") or "")[:MAX_NAME],
        quantization=str(quantization)[:MAX_NAME] if quantization is not None else None,
    )
    return SourceStep(resolved, "resolved", name)
