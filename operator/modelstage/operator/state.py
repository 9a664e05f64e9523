"""``spec + observed -> next action + status``: the ModelDeployment state machine.

Phases: Pending -> Staging -> Staged -> RollingOut -> Ready, and Failed from any of them.
The decision is a pure function of the desired artifact, the last status and what the kopf
shell observed (``observe.py``: the Job of the desired digest, the target workload's
rollout, the validation findings); the shell (``act.py``) writes the status and executes the
one action.
``decide`` tells the situation apart (resolving, invalid, rolled back, staged and rolling out,
staging) and one small function per situation drafts the phase, the ``Staged`` condition and
the action; ``_new_status`` turns the draft into the status. Conditions ``Staged``, ``Ready``
and ``Degraded`` carry the human-readable reasons.

Resolution (``resolve_plan.py``): the desired artifact's digest is taken from the source's
resolved identity. Until one is known the phase stays ``Pending`` with ``Staged=False/
Resolving`` (the resolve Job's creation is this machine's action); a later resolution that
finds a changed source gives a new desired digest, staged and rolled out like a spec change.

Node caching (``spec.nodeCache``): between staged and the roll, the artifact is copied to the
nodes' local disks; the roll waits (phase ``Staged``) until ``node_cache_plan`` says the copies
are ready or their deadline passed, and its copy Jobs are this machine's action meanwhile.
The ``NodeCached`` condition and ``status.nodeCache`` say where the copies stand.

Rollback: when pods on a new artifact fail, the workload goes back to ``previousArtifact``
and the failed digest is remembered, so the same spec is not rolled out again (a spec change
that alters the digest clears it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from modelstage.api.modeldeployment import (
    ArtifactStatus,
    Condition,
    FormatStatus,
    ModelDeploymentStatus,
    Phase,
)

from .artifact import Artifact
from .conditions import condition, merge_conditions
from .observations import JobObservation, Observed, WorkloadObservation, parse_summary
from .validation import Finding, findings_condition

if TYPE_CHECKING:
    from .resolve_plan import SourceStep


class Action(Enum):
    WAIT = "wait"
    CREATE_JOB = "create-job"
    CREATE_RESOLVE_JOB = "create-resolve-job"
    CREATE_COPY_JOBS = "create-copy-jobs"
    CREATE_CAPTURE_JOB = "create-capture-job"
    ROLL_OUT = "roll-out"
    ROLL_BACK = "roll-back"


@dataclass(frozen=True)
class Decision:
    action: Action
    status: ModelDeploymentStatus
    artifact: ArtifactStatus | None = None
    """The artifact to roll out or back to (for those actions)."""
    details: str = ""


def _artifact_status(
    artifact: Artifact, summary: Mapping[str, Any], at: datetime
) -> ArtifactStatus:
    return ArtifactStatus(
        digest=artifact.digest,
        uri=artifact.location.uri,
        format=artifact.load_format,
        tensor_parallel_size=artifact.tp,
        pipeline_parallel_size=artifact.pp,
        layer_partition=artifact.pp_partition,
        source=_identity(summary),
        bytes=int(summary["bytes"]) if summary.get("bytes") is not None else None,
        files=int(summary["files"]) if summary.get("files") is not None else None,
        staged_at=at,
        stage_seconds=float(summary["seconds"]) if summary.get("seconds") is not None else None,
    )


def _identity(summary: Mapping[str, Any]) -> str | None:
    """The source identity the stager staged from (older stagers: the source URI)."""
    value = summary.get("sourceIdentity") or summary.get("source")
    return str(value) if value is not None else None


def _ready(observed: Observed) -> tuple[Literal["True", "False"], str, str]:
    """Whether the workload serves some artifact healthily, whatever the spec asks for."""
    w = observed.workload
    if w is None:
        return "False", "TargetNotFound", "the target workload does not exist"
    refused = next((f for f in observed.findings if f.reason == "TargetNotOptedIn"), None)
    if refused is not None:
        return "False", refused.reason, refused.message
    if w.digest is None:
        return "False", "NotRolledOut", "the workload does not serve a modelstage artifact yet"
    if w.failing or w.stalled or not w.complete:
        return "False", "RollingOut", f"{w.updated}/{w.replicas} updated, {w.available} available"
    return "True", "Serving", f"serving artifact {w.digest}: {w.available}/{w.replicas} available"


def _changed_by_someone_else(w: WorkloadObservation, status: ModelDeploymentStatus) -> bool:
    """Seen on the artifact before, off it at a later generation: not ours to undo. (A patch
    that never landed, e.g. an operator killed mid-rollout, leaves the generation as it was.)"""
    return status.workload_generation is not None and w.generation > status.workload_generation


@dataclass
class _Draft:
    """The decision under construction: the phase, the ``Staged`` condition, a failure to
    report beside the validation findings, status fields to update, and the action."""

    phase: Phase
    staged: tuple[Literal["True", "False", "Unknown"], str, str]
    degraded: tuple[str, str] | None = None
    """(reason, message) of a failure to report beside the validation findings."""
    updates: dict[str, Any] = field(default_factory=dict)
    action: Action = Action.WAIT
    target: ArtifactStatus | None = None
    """The artifact to roll out or back to."""
    details: str = ""


def decide(
    desired: Artifact | None,
    status: ModelDeploymentStatus,
    observed: Observed,
    source: SourceStep | None = None,
) -> Decision:
    """The next action and the status to write. ``desired`` is None when the spec cannot be
    turned into an artifact (the findings then say why) or while ``source`` (the resolution
    step; None: not tracked) knows no identity yet."""
    blocks_staging = [f for f in observed.findings if f.blocks == "staging"]
    unresolved = source is not None and source.source is None and not blocks_staging
    if unresolved and desired is None:
        assert source is not None
        draft = _resolving(source)
    elif desired is None or blocks_staging:
        draft = _invalid(blocks_staging)
    else:
        draft = _situation(desired, status, observed)
    if source is not None and not unresolved and not blocks_staging:
        _resolution_beside(draft, source)
    step = observed.node_cache
    copies = step is not None and (step.create or step.replace)
    if step is not None and copies and draft.action is Action.WAIT and _may_copy(observed):
        draft.action = Action.CREATE_COPY_JOBS
        draft.details = (
            f"copying artifact {step.status.digest} to {len(step.create)} node(s)"
            if step.create
            else f"{len(step.replace)} node(s) lost artifact {step.status.digest}: copying again"
        )
    capture = observed.engine_cache
    if capture is not None and capture.create and draft.action is Action.WAIT:
        draft.action = Action.CREATE_CAPTURE_JOB
        draft.details = f"capturing the engine cache {capture.status.uri if capture.status else ''}"
    new_status = _new_status(draft, desired, status, observed, source)
    return Decision(draft.action, new_status, draft.target, draft.details)


def _may_copy(observed: Observed) -> bool:
    """Copy Jobs only for a workload that opted into node caching and may be rolled: a
    finding that blocks staging or the roll (a workload not opted in, among them) stops them
    (a copy is work on the nodes done for the roll alone)."""
    return observed.node_cache_enabled and not any(
        f.blocks in ("staging", "rollout") for f in observed.findings
    )


def _situation(desired: Artifact, status: ModelDeploymentStatus, observed: Observed) -> _Draft:
    """Where a stageable artifact stands: rolled back from, staged (rolling out), or not yet."""
    blocks_rollout = any(f.blocks == "rollout" for f in observed.findings)
    current = status.artifact
    if status.failed_digest == desired.digest:
        return _rolled_back(desired, status, observed.workload, blocks_rollout)
    if current is not None and current.digest == desired.digest:
        return _rolling_out(desired, status, observed, blocks_rollout)
    return _staging(desired, status, observed, blocks_rollout)


def _resolving(source: SourceStep) -> _Draft:
    """No identity is known for the spec's source yet: the resolution runs, or failed."""
    if source.state == "failed":
        return _Draft(
            "Failed",
            ("False", "ResolveFailed", source.message),
            ("ResolveFailed", source.message),
        )
    draft = _Draft("Pending", ("False", "Resolving", source.message))
    if source.state == "create":
        draft.action, draft.details = Action.CREATE_RESOLVE_JOB, source.message
    return draft


def _invalid(blocks_staging: Sequence[Finding]) -> _Draft:
    """The spec cannot be staged: the first blocking finding says why."""
    first = blocks_staging[0] if blocks_staging else None
    reason = first.reason if first else "InvalidSpec"
    message = first.message if first else "the spec does not name a stageable artifact"
    return _Draft("Failed", ("False", reason, message))


def _rolled_back(
    desired: Artifact,
    status: ModelDeploymentStatus,
    w: WorkloadObservation | None,
    blocks_rollout: bool,
) -> _Draft:
    """The desired artifact's pods failed and the workload went back: stay there; redo a
    rollback that was decided but not applied (the shell stopped in between)."""
    current = status.artifact
    back_to = current.digest if current else "its previous artifact"
    draft = _Draft(
        "Failed",
        ("True", "Staged", f"artifact {desired.digest} is staged"),
        ("RolledBack", _rolled_back_message(desired.digest, status.failure_reason, back_to)),
    )
    if current is not None and w is not None and w.digest != current.digest and not blocks_rollout:
        draft.action, draft.target = Action.ROLL_BACK, current
        draft.details = f"rolling back to {current.digest}"
    return draft


def _copies_done(observed: Observed) -> bool:
    """With node caching on, the roll waits until the copies are ready or the deadline
    passed (``node_cache_plan``)."""
    return not observed.node_cache_enabled or (
        observed.node_cache is not None and observed.node_cache.roll
    )


def _capture_done(observed: Observed) -> bool:
    """With the engine cache on, the roll waits until it is captured, or cannot be, or its
    deadline passed (``engine_cache_plan``)."""
    return not observed.engine_cache_enabled or (
        observed.engine_cache is not None and observed.engine_cache.roll
    )


def _may_roll(observed: Observed) -> bool:
    return _copies_done(observed) and _capture_done(observed)


def _engine_cache_moved(w: WorkloadObservation, observed: Observed) -> str | None:
    """Why the workload, on the desired artifact, is patched again for its engine cache: it
    is given a cache that is no longer the one wanted (an engine argument, the image or the
    setting changed), and the wanted one is captured or will not be. A workload rolled
    without a cache is not restarted for one captured later: the next roll takes it."""
    if w.engine_cache is None or not _capture_done(observed):
        return None
    step = observed.engine_cache
    wanted = step.use.uri if step is not None and step.use is not None else None
    if wanted == w.engine_cache:
        return None
    if wanted is None:
        return f"the workload's engine cache {w.engine_cache} is not this configuration's"
    return f"the engine cache is now {wanted} (was {w.engine_cache})"


def _mounts_copy(observed: Observed) -> bool:
    """The workload is to mount a node-local copy: node caching on and a chosen node holds
    one (at the deadline without any, it rolls without; a copy made later rolls it again)."""
    step = observed.node_cache
    return observed.node_cache_enabled and step is not None and step.copy is not None


def _rolling_out(
    desired: Artifact,
    status: ModelDeploymentStatus,
    observed: Observed,
    blocks_rollout: bool,
) -> _Draft:
    """The desired artifact is staged: patch the workload onto it (once its node-local copies
    are ready, with node caching on), follow its rollout, and roll back when its pods fail."""
    w = observed.workload
    draft = _Draft("RollingOut", ("True", "Staged", f"artifact {desired.digest} is staged"))
    if w is not None and w.digest == desired.digest:
        draft.updates["workload_generation"] = w.generation
    if w is None or blocks_rollout:
        draft.phase = "Staged"
    elif w.digest != desired.digest and _changed_by_someone_else(w, status):
        draft.phase = "Staged"
        draft.degraded = (
            "WorkloadChanged",
            f"the workload was changed by someone else (generation {w.generation}) and no "
            f"longer runs artifact {desired.digest}; modelstage does not patch it back: keep "
            "the modelstage fields in its manifest, or change the ModelDeployment spec to "
            "roll out again",
        )
    elif w.digest != desired.digest and not _may_roll(observed):
        draft.phase = "Staged"
    elif w.digest != desired.digest:
        draft.action, draft.target = Action.ROLL_OUT, status.artifact
        draft.details = f"the workload is not on artifact {desired.digest}: patching it"
    elif w.failing or w.stalled:
        _rollout_failed(draft, desired, status, w)
    elif w.node_cache != _mounts_copy(observed) and _copies_done(observed):
        draft.action, draft.target = Action.ROLL_OUT, status.artifact
        on = "on" if _mounts_copy(observed) else "off"
        draft.details = f"node caching turned {on}: patching the workload on {desired.digest}"
    elif (moved := _engine_cache_moved(w, observed)) is not None:
        draft.action, draft.target = Action.ROLL_OUT, status.artifact
        draft.details = f"{moved}: patching the workload on {desired.digest}"
    elif w.complete:
        draft.phase = "Ready"
    return draft


def _rollout_failed(
    draft: _Draft, desired: Artifact, status: ModelDeploymentStatus, w: WorkloadObservation
) -> None:
    """Pods on the desired artifact fail: back to the previous artifact, if there is one."""
    reason = "; ".join(w.failing) or "the rollout exceeded its progress deadline"
    draft.phase = "Failed"
    previous = status.previous_artifact
    if previous is None:
        draft.degraded = (
            "RolloutFailed",
            f"pods on artifact {desired.digest} fail ({reason}) and there is no "
            "previous artifact to roll back to: fix the workload or the spec",
        )
        return
    draft.action, draft.target = Action.ROLL_BACK, previous
    draft.degraded = ("RolledBack", _rolled_back_message(desired.digest, reason, previous.digest))
    draft.updates = {
        "artifact": previous,
        "previous_artifact": None,
        "failed_digest": desired.digest,
        "failure_reason": reason,
        "workload_generation": None,
    }
    draft.details = f"rolling back to {previous.digest}: {reason}"


def _staging(
    desired: Artifact, status: ModelDeploymentStatus, observed: Observed, blocks_rollout: bool
) -> _Draft:
    """The desired artifact is not staged yet: create its Job, follow it, report its end."""
    job = observed.job
    if job is None:
        draft = _Draft("Staging", ("False", "JobCreated", f"staging artifact {desired.digest}"))
        draft.action = Action.CREATE_JOB
        draft.details = f"creating the stager Job for {desired.digest}"
        return draft
    if job.state == "Running":
        progress = f": {job.progress}" if job.progress else ""
        follow = f" (follow: kubectl logs -f job/{job.name})" if job.name else ""
        message = f"staging artifact {desired.digest}{progress}{follow}"
        return _Draft("Staging", ("False", "Staging", message))
    if job.state == "Failed":
        lines = job.message.strip().splitlines()
        message = lines[-1] if lines else "the stager Job failed"
        return _Draft(
            "Failed",
            ("False", "StagingFailed", message),
            ("StagingFailed", f"staging artifact {desired.digest} failed: {message}"),
        )
    return _staged(desired, status, observed, job, blocks_rollout)


def _staged(
    desired: Artifact,
    status: ModelDeploymentStatus,
    observed: Observed,
    job: JobObservation,
    blocks_rollout: bool,
) -> _Draft:
    """The stager Job succeeded: record the artifact and roll the workload onto it."""
    summary = parse_summary(job.message) or {"digest": desired.digest}
    if summary.get("digest") != desired.digest:
        return _Draft(
            "Failed",
            (
                "False",
                "ArtifactMismatch",
                f"the stager reported digest {summary.get('digest')}, expected {desired.digest}",
            ),
            (
                "ArtifactMismatch",
                "the stager image does not compute the operator's digest: use matching "
                "operator and stager versions",
            ),
        )
    staged = _artifact_status(desired, summary, job.finished_at or observed.now)
    draft = _Draft("Staged", ("True", "Staged", _staged_message(staged)))
    if observed.workload is not None and not blocks_rollout:
        draft.action, draft.target, draft.phase = Action.ROLL_OUT, staged, "RollingOut"
        draft.updates = {
            "artifact": staged,
            "previous_artifact": status.artifact or status.previous_artifact,
            "workload_generation": None,
        }
        draft.details = f"artifact {desired.digest} staged: rolling the workload onto it"
        if not _may_roll(observed):  # recorded as staged; rolls once copied and captured
            draft.action, draft.target, draft.phase = Action.WAIT, None, "Staged"
            what = "copying it to the nodes" if not _copies_done(observed) else "capturing"
            draft.details = f"artifact {desired.digest} staged: {what}"
    return draft


def _resolution_beside(draft: _Draft, source: SourceStep) -> None:
    """A periodic resolution of a source whose identity is known: a failure is reported (the
    recorded identity still holds), a due one is started when nothing else is to be done."""
    if source.state == "failed" and draft.degraded is None:
        draft.degraded = ("ResolveFailed", source.message)
    elif source.state == "create" and draft.action is Action.WAIT:
        draft.action, draft.details = Action.CREATE_RESOLVE_JOB, source.message


def _new_status(
    draft: _Draft,
    desired: Artifact | None,
    status: ModelDeploymentStatus,
    observed: Observed,
    source: SourceStep | None,
) -> ModelDeploymentStatus:
    """The status to write: the draft's phase and conditions, merged into the last ones."""
    now, gen = observed.now, observed.generation
    findings = list(observed.findings)
    still_failed = desired is not None and status.failed_digest == desired.digest
    updates: list[Condition] = [
        condition("Staged", *draft.staged, now=now, generation=gen),
        condition("Ready", *_ready(observed), now=now, generation=gen),
    ]
    if draft.degraded is not None:
        reason, message = draft.degraded
        extra = "; ".join(f.message for f in findings)
        message = f"{message}; {extra}" if extra else message
        updates.append(condition("Degraded", "True", reason, message, now=now, generation=gen))
    else:
        updates.append(findings_condition(findings, now=now, generation=gen))
    node_cache = status.node_cache
    step = observed.node_cache
    if step is not None:
        node_cache = step.status
        updates.append(condition("NodeCached", *step.condition, now=now, generation=gen))
    conditions = merge_conditions(status.conditions, updates)
    if not observed.node_cache_enabled:
        node_cache = None
        conditions = [c for c in conditions if c.type != "NodeCached"]
    cache_update = {"node_cache": node_cache} if node_cache != status.node_cache else {}
    conditions, engine_update = _engine_cache_status(conditions, status, observed)
    return status.model_copy(
        update={
            "phase": draft.phase,
            "reason": headline(conditions),
            "observed_generation": gen,
            "desired_digest": desired.digest if desired else None,
            "format": _format(desired) if desired else status.format,
            "vllm_version": desired.vllm_version if desired else status.vllm_version,
            "source": source.source if source is not None else status.source,
            "conditions": conditions,
            "failed_digest": status.failed_digest if still_failed else None,
            "failure_reason": status.failure_reason if still_failed else None,
            "queue_position": None,
            **cache_update,
            **engine_update,
            **draft.updates,
        }
    )


def _engine_cache_status(
    conditions: list[Condition], status: ModelDeploymentStatus, observed: Observed
) -> tuple[list[Condition], dict[str, Any]]:
    """``EngineCached`` and ``status.engineCache`` from the engine cache's step; both go when
    the engine cache is off. Kept as they were while there is no step (not staged yet)."""
    if not observed.engine_cache_enabled:
        without = [c for c in conditions if c.type != "EngineCached"]
        return without, {"engine_cache": None} if status.engine_cache is not None else {}
    step = observed.engine_cache
    if step is None:
        return conditions, {}
    update = condition(
        "EngineCached", *step.condition, now=observed.now, generation=observed.generation
    )
    merged = merge_conditions(conditions, [update])
    return merged, {"engine_cache": step.status} if step.status != status.engine_cache else {}


def _format(desired: Artifact) -> FormatStatus:
    return FormatStatus(name=desired.load_format, reason=desired.format_reason)


def queued(
    decision: Decision, position: int, limit: int, observed: Observed, per_namespace: int = 0
) -> Decision:
    """The stage Job must wait for a slot (``slots.StagerSlots``): no action, phase
    ``Pending``, ``Staged=False/Queued`` with the place in the queue."""
    digest = decision.status.desired_digest
    limits = [f"{limit} stager Job{'s' if limit != 1 else ''} at once"] if limit > 0 else []
    if per_namespace > 0:
        limits.append(f"{per_namespace} per namespace")
    message = (
        f"artifact {digest} waits for a stager slot: position {position} in the queue "
        f"(at most {', '.join(limits)})"
    )
    update = condition(
        "Staged", "False", "Queued", message, now=observed.now, generation=observed.generation
    )
    conditions = merge_conditions(decision.status.conditions, [update])
    status = decision.status.model_copy(
        update={
            "phase": "Pending",
            "reason": headline(conditions),
            "queue_position": position,
            "conditions": conditions,
        }
    )
    return Decision(Action.WAIT, status, details=message if position == 1 else "")


WAITING_FOR_COPIES = frozenset({"Copying", "Warming", "CopyFailed", "NoEligibleNodes"})
"""``NodeCached`` reasons of a roll that waits for node-local copies."""


def headline(conditions: Sequence[Condition]) -> str | None:
    """The one reason ``kubectl get`` shows: ``Degraded``'s when true, else ``Staged``'s until
    the artifact is staged, else ``NodeCached``'s while the roll waits for the copies, else
    ``EngineCached``'s while a workload not serving yet waits for the capture, else
    ``Ready``'s."""
    by_type = {c.type: c for c in conditions}
    degraded, staged, ready = (by_type.get(t) for t in ("Degraded", "Staged", "Ready"))
    cached = by_type.get("NodeCached")
    if degraded is not None and degraded.status == "True":
        return degraded.reason
    if staged is not None and staged.status != "True":
        return staged.reason
    if cached is not None and cached.reason in WAITING_FOR_COPIES:
        return cached.reason
    capture = by_type.get("EngineCached")
    serving = ready is not None and ready.status == "True"
    if capture is not None and capture.reason == "Capturing" and not serving:
        return capture.reason
    return ready.reason if ready is not None else None


def _rolled_back_message(failed: str, reason: str | None, back_to: str) -> str:
    """The ``RolledBack`` condition's message; the same words whenever it is re-decided, so the
    pods' failure reason survives the reconciliations that follow the rollback."""
    why = f" ({reason})" if reason else ""
    return (
        f"pods on artifact {failed} failed{why}; rolled back to artifact {back_to}; "
        "change the spec to try again"
    )


def _staged_message(artifact: ArtifactStatus) -> str:
    size = f", {artifact.bytes / 1e9:.2f} GB" if artifact.bytes is not None else ""
    took = f" in {artifact.stage_seconds:.0f} s" if artifact.stage_seconds is not None else ""
    return f"artifact {artifact.digest} staged{size}{took}"
