"""``spec + observed -> next action + status``: the ModelDeployment state machine.

Phases: Pending -> Staging -> Staged -> RollingOut -> Ready, and Failed from any of them.
The decision is a pure function of the desired artifact, the last status and what the kopf
shell observed (the Job of the desired digest, the target workload's rollout, the validation
findings); the shell executes the one action and writes the status. Conditions ``Staged``,
``Ready`` and ``Degraded`` carry the human-readable reasons.

Resolution (``resolve_plan.py``): the desired artifact's digest is taken from the source's
resolved identity. Until one is known the phase stays ``Pending`` with ``Staged=False/
Resolving`` (the resolve Job's creation is this machine's action); a later resolution that
finds a changed source gives a new desired digest, staged and rolled out like a spec change.

Rollback: when pods on a new artifact fail, the workload goes back to ``previousArtifact``
and the failed digest is remembered, so the same spec is not rolled out again (a spec change
that alters the digest clears it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from .api import ArtifactStatus, Condition, ModelDeploymentStatus, Phase
from .artifact import Artifact
from .conditions import condition, merge_conditions
from .kube import DIGEST_ANNOTATION, Manifest
from .validation import Finding, findings_condition

if TYPE_CHECKING:
    from .resolve_plan import SourceStep


class Action(Enum):
    WAIT = "wait"
    CREATE_JOB = "create-job"
    CREATE_RESOLVE_JOB = "create-resolve-job"
    ROLL_OUT = "roll-out"
    ROLL_BACK = "roll-back"


JobState = Literal["Running", "Succeeded", "Failed"]


@dataclass(frozen=True)
class JobObservation:
    """The stager Job of the desired digest."""

    state: JobState
    message: str = ""
    """The stager's termination message: the JSON summary, or the failure reason."""
    finished_at: datetime | None = None
    """When it succeeded (``completionTime``) or failed (its condition's transition)."""
    name: str = ""
    progress: str = ""
    """While it runs: the stager's latest progress line (``progress_line``)."""


@dataclass(frozen=True)
class WorkloadObservation:
    """The target Deployment or StatefulSet, reduced to what the rollout decision needs."""

    digest: str | None
    generation: int = 1
    observed_generation: int = 1
    replicas: int = 1
    updated: int = 1
    available: int = 1
    failing: tuple[str, ...] = ()
    """Why pods of the current template fail (crash loops, image pulls, init errors)."""
    stalled: bool = False
    """The workload controller gave up (Deployment ``ProgressDeadlineExceeded``)."""

    @property
    def complete(self) -> bool:
        return (
            self.observed_generation >= self.generation
            and self.updated >= self.replicas
            and self.available >= self.replicas
        )


@dataclass(frozen=True)
class Observed:
    generation: int
    now: datetime
    job: JobObservation | None = None
    workload: WorkloadObservation | None = None
    findings: Sequence[Finding] = field(default_factory=tuple)


@dataclass(frozen=True)
class Decision:
    action: Action
    status: ModelDeploymentStatus
    artifact: ArtifactStatus | None = None
    """The artifact to roll out or back to (for those actions)."""
    details: str = ""


def observe_job(job: Manifest, termination_message: str = "") -> JobObservation:
    """Reads a Job's conditions; the shell passes the termination message of its last pod."""
    status = job.get("status") or {}
    name = str((job.get("metadata") or {}).get("name") or "")
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            return JobObservation(
                "Succeeded", termination_message, _time(status.get("completionTime")), name
            )
        if cond.get("type") in ("Failed", "FailureTarget"):
            message = termination_message or cond.get("message") or cond.get("reason") or ""
            return JobObservation(
                "Failed", message, _time(cond.get("lastTransitionTime")), name=name
            )
    return JobObservation("Running", termination_message, name=name)


PROGRESS_CHARS = 240


def staging_progress(job: Manifest, pods: Sequence[Manifest], log_tail: str = "") -> str:
    """A running stage Job's progress in words: its workers done (an Indexed Job), since when
    its first pod runs, and the stager's latest progress line when ``log_tail`` (the tail of
    a running stager's log) holds one. Stable between reconciliations unless something moved,
    so the status is not rewritten for nothing."""
    parts = []
    completions = int((job.get("spec") or {}).get("completions") or 1)
    if completions > 1:
        done = int((job.get("status") or {}).get("succeeded") or 0)
        parts.append(f"{done}/{completions} workers done")
    started = sorted(
        str((p.get("status") or {}).get("startTime"))
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running"
        and (p.get("status") or {}).get("startTime")
    )
    if started:
        parts.append(f"running since {started[0]}")
    line = progress_line(log_tail)
    if line:
        parts.append(line)
    return "; ".join(parts)


def progress_line(log: str) -> str:
    """The latest progress line of a stager's log tail (the last with a percentage): what
    the ``Staged`` condition shows while the Job runs."""
    for line in reversed(log.splitlines()):
        line = line.strip().rsplit("\r", 1)[-1]
        if "%" in line and not line.startswith(("{", "error:")):
            return line[:PROGRESS_CHARS]
    return ""


def observe_workload(workload: Manifest, failing: Sequence[str] = ()) -> WorkloadObservation:
    """Reads a Deployment's or StatefulSet's rollout progress from its status."""
    spec = workload.get("spec") or {}
    status = workload.get("status") or {}
    annotations = ((spec.get("template") or {}).get("metadata") or {}).get("annotations") or {}
    stalled = any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in status.get("conditions") or []
    )
    return WorkloadObservation(
        digest=annotations.get(DIGEST_ANNOTATION),
        generation=int((workload.get("metadata") or {}).get("generation", 1)),
        observed_generation=int(status.get("observedGeneration", 0)),
        replicas=int(spec.get("replicas", 1)),
        updated=int(status.get("updatedReplicas", 0)),
        available=int(status.get("availableReplicas", status.get("readyReplicas", 0))),
        failing=tuple(failing),
        stalled=stalled,
    )


STAGER_CONTAINER = "stager"
WAITING_FAILURES = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
"""Waiting reasons of a container that will not start without a change to the pod."""


def _terminations(pod: Manifest, container: str) -> list[Manifest]:
    status = pod.get("status") or {}
    out: list[Manifest] = []
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != container:
            continue
        for key in ("state", "lastState"):
            terminated = (cs.get(key) or {}).get("terminated")
            if terminated:
                out.append(terminated)
    return out


def termination_message(
    pods: Sequence[Manifest], *, success: bool, container: str = STAGER_CONTAINER
) -> str:
    """The stager's termination message from its Job's pods: on success the latest summary
    (a message that parses as one, else the latest of exit code 0), on failure the latest
    message of a non-zero exit."""
    found = [
        t
        for pod in pods
        for t in _terminations(pod, container)
        if (t.get("exitCode", 0) == 0) == success
    ]
    found.sort(key=lambda t: str(t.get("finishedAt") or ""))
    messages = [str(t.get("message") or "") for t in found]
    if success:
        summaries = [m for m in messages if parse_summary(m) is not None]
        messages = summaries or messages
    return messages[-1] if messages else ""


def pod_failures(pods: Sequence[Manifest], digest: str | None) -> tuple[str, ...]:
    """Why pods of artifact ``digest`` (their template's digest annotation) fail: containers or
    initContainers stuck in a crash loop or image pull, or pods that failed outright. Each
    reason names the pod, the container and, when there is one, its last termination message."""
    reasons: set[str] = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        if digest is None or (meta.get("annotations") or {}).get(DIGEST_ANNOTATION) != digest:
            continue
        if meta.get("deletionTimestamp"):
            continue
        name = meta.get("name", "?")
        status = pod.get("status") or {}
        for cs in [
            *(status.get("initContainerStatuses") or []),
            *(status.get("containerStatuses") or []),
        ]:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason not in WAITING_FAILURES:
                continue
            last = ((cs.get("lastState") or {}).get("terminated") or {}).get("message") or ""
            last = last.strip().splitlines()[-1][:200] if last.strip() else ""
            detail = f": {last}" if last else ""
            reasons.add(f"pod {name}, container {cs.get('name', '?')}: {reason}{detail}")
        if status.get("phase") == "Failed":
            why = status.get("reason") or status.get("message") or "failed"
            reasons.add(f"pod {name}: {why}")
    return tuple(sorted(reasons))


def parse_summary(message: str) -> Mapping[str, Any] | None:
    """The stager's one-line JSON summary (its last line), or None."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return None
    try:
        summary = json.loads(lines[-1])
    except (ValueError, RecursionError):  # whatever a pod wrote: not a summary
        return None
    return summary if isinstance(summary, dict) and "digest" in summary else None


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)


def _artifact_status(
    artifact: Artifact, summary: Mapping[str, Any], at: datetime
) -> ArtifactStatus:
    return ArtifactStatus(
        digest=artifact.digest,
        uri=artifact.location.uri,
        format=artifact.load_format,
        tensor_parallel_size=artifact.tensor_parallel,
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
    """The status under construction inside ``decide``."""

    phase: Phase
    staged: tuple[Literal["True", "False", "Unknown"], str, str]
    degraded: tuple[str, str] | None = None
    """(reason, message) of a failure to report beside the validation findings."""
    updates: dict[str, Any] = field(default_factory=dict)


def decide(
    desired: Artifact | None,
    status: ModelDeploymentStatus,
    observed: Observed,
    source: SourceStep | None = None,
) -> Decision:
    """The next action and the status to write. ``desired`` is None when the spec cannot be
    turned into an artifact (the findings then say why) or while ``source`` (the resolution
    step; None: not tracked) knows no identity yet."""
    findings = list(observed.findings)
    blocks_staging = [f for f in findings if f.blocks == "staging"]
    blocks_rollout = [f for f in findings if f.blocks == "rollout"]
    w = observed.workload
    action, target, details = Action.WAIT, None, ""
    current = status.artifact
    unresolved = source is not None and source.source is None and not blocks_staging

    if unresolved and desired is None:
        assert source is not None
        if source.state == "failed":
            draft = _Draft(
                "Failed", ("False", "ResolveFailed", source.message),
                ("ResolveFailed", source.message),
            )  # fmt: skip
        else:
            draft = _Draft("Pending", ("False", "Resolving", source.message))
            if source.state == "create":
                action, details = Action.CREATE_RESOLVE_JOB, source.message
    elif desired is None or blocks_staging:
        first = blocks_staging[0] if blocks_staging else None
        draft = _Draft(
            "Failed",
            (
                "False",
                first.reason if first else "InvalidSpec",
                first.message if first else "the spec does not name a stageable artifact",
            ),
        )
    elif status.failed_digest == desired.digest:
        draft = _Draft(
            "Failed",
            ("True", "Staged", f"artifact {desired.digest} is staged"),
            (
                "RolledBack",
                _rolled_back_message(
                    desired.digest,
                    status.failure_reason,
                    current.digest if current else "its previous artifact",
                ),
            ),
        )
        if (
            current is not None
            and w is not None
            and w.digest != current.digest
            and not blocks_rollout
        ):
            # The rollback was decided but not applied (the shell stopped in between): redo it.
            action, target = Action.ROLL_BACK, current
            details = f"rolling back to {current.digest}"
    elif current is not None and current.digest == desired.digest:
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
        elif w.digest != desired.digest:
            action, target = Action.ROLL_OUT, current
            details = f"the workload is not on artifact {desired.digest}: patching it"
        elif w.failing or w.stalled:
            reason = "; ".join(w.failing) or "the rollout exceeded its progress deadline"
            if status.previous_artifact is not None:
                action, target = Action.ROLL_BACK, status.previous_artifact
                draft.phase = "Failed"
                draft.degraded = (
                    "RolledBack",
                    _rolled_back_message(desired.digest, reason, status.previous_artifact.digest),
                )
                draft.updates = {
                    "artifact": status.previous_artifact,
                    "previous_artifact": None,
                    "failed_digest": desired.digest,
                    "failure_reason": reason,
                    "workload_generation": None,
                }
                details = f"rolling back to {status.previous_artifact.digest}: {reason}"
            else:
                draft.phase = "Failed"
                draft.degraded = (
                    "RolloutFailed",
                    f"pods on artifact {desired.digest} fail ({reason}) and there is no "
                    "previous artifact to roll back to: fix the workload or the spec",
                )
        elif w.complete:
            draft.phase = "Ready"
    else:
        job = observed.job
        if job is None:
            action = Action.CREATE_JOB
            draft = _Draft("Staging", ("False", "JobCreated", f"staging artifact {desired.digest}"))
            details = f"creating the stager Job for {desired.digest}"
        elif job.state == "Running":
            progress = f": {job.progress}" if job.progress else ""
            follow = f" (follow: kubectl logs -f job/{job.name})" if job.name else ""
            message = f"staging artifact {desired.digest}{progress}{follow}"
            draft = _Draft("Staging", ("False", "Staging", message))
        elif job.state == "Failed":
            message = (
                job.message.strip().splitlines()[-1]
                if job.message.strip()
                else "the stager Job failed"
            )
            draft = _Draft(
                "Failed",
                ("False", "StagingFailed", message),
                ("StagingFailed", f"staging artifact {desired.digest} failed: {message}"),
            )
        else:
            summary = parse_summary(job.message) or {"digest": desired.digest}
            if summary.get("digest") != desired.digest:
                draft = _Draft(
                    "Failed",
                    (
                        "False",
                        "ArtifactMismatch",
                        f"the stager reported digest {summary.get('digest')}, "
                        f"expected {desired.digest}",
                    ),
                    (
                        "ArtifactMismatch",
                        "the stager image does not compute the operator's "
                        "digest: use matching operator and stager versions",
                    ),
                )
            else:
                staged = _artifact_status(desired, summary, job.finished_at or observed.now)
                draft = _Draft("Staged", ("True", "Staged", _staged_message(staged)))
                if w is not None and not blocks_rollout:
                    action, target = Action.ROLL_OUT, staged
                    draft.phase = "RollingOut"
                    draft.updates = {
                        "artifact": staged,
                        "previous_artifact": current or status.previous_artifact,
                        "workload_generation": None,
                    }
                    details = f"artifact {desired.digest} staged: rolling the workload onto it"

    if source is not None and not unresolved and not blocks_staging and source.state != "resolved":
        if source.state == "failed" and draft.degraded is None:
            # A periodic resolution failed: the recorded identity still holds; say so.
            draft.degraded = ("ResolveFailed", source.message)
        elif source.state == "create" and action is Action.WAIT:
            action, details = Action.CREATE_RESOLVE_JOB, source.message

    now, gen = observed.now, observed.generation
    still_failed = desired is not None and status.failed_digest == desired.digest
    updates: list[Condition] = [
        condition(
            "Staged", draft.staged[0], draft.staged[1], draft.staged[2], now=now, generation=gen
        ),
        condition("Ready", *_ready(observed), now=now, generation=gen),
    ]
    if draft.degraded is not None:
        reason, message = draft.degraded
        extra = "; ".join(f.message for f in findings)
        updates.append(
            condition(
                "Degraded",
                "True",
                reason,
                f"{message}; {extra}" if extra else message,
                now=now,
                generation=gen,
            )
        )
    else:
        updates.append(findings_condition(findings, now=now, generation=gen))
    conditions = merge_conditions(status.conditions, updates)
    new_status = status.model_copy(
        update={
            "phase": draft.phase,
            "reason": headline(conditions),
            "observed_generation": gen,
            "desired_digest": desired.digest if desired else None,
            "source": source.source if source is not None else status.source,
            "conditions": conditions,
            "failed_digest": status.failed_digest if still_failed else None,
            "failure_reason": status.failure_reason if still_failed else None,
            "queue_position": None,
            **draft.updates,
        }
    )
    return Decision(action=action, status=new_status, artifact=target, details=details)


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


def headline(conditions: Sequence[Condition]) -> str | None:
    """The one reason ``kubectl get`` shows: ``Degraded``'s when true, else ``Staged``'s until
    the artifact is staged, else ``Ready``'s."""
    by_type = {c.type: c for c in conditions}
    degraded, staged, ready = (by_type.get(t) for t in ("Degraded", "Staged", "Ready"))
    if degraded is not None and degraded.status == "True":
        return degraded.reason
    if staged is not None and staged.status != "True":
        return staged.reason
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
