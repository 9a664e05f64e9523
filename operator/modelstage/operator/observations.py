"""``cluster objects -> observations``: what ``decide`` is told about Jobs, pods and workloads.

Pure functions of the objects the kopf shell read (a Job, its pods, the target Deployment,
StatefulSet or LeaderWorkerSet): the Job's state and the stager's termination message, a
running Job's progress, the workload's rollout progress and why its pods fail.
``state.decide`` takes the result, never a raw object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from modelstage.api.modeldeployment import EngineCacheStatus, NodeCacheStatus
from modelstage.api.nodecache import HeldCopy
from modelstage.api.objects import DIGEST_ANNOTATION, KubeObject

from .kube import ENGINE_CACHE_ANNOTATION, VOLUME_NODE_CACHE
from .rollout_plan import EngineCacheUse
from .validation import Finding
from .workload_kinds import LWS_WORKER_INDEX_LABEL, kind_of, replicas, serving_template

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
    """The target workload, reduced to what the rollout decision needs."""

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
    node_cache: bool = False
    """Its pod template mounts the nodes' cache root (``spec.nodeCache``)."""
    engine_cache: str | None = None
    """The engine cache its pod template's prepare is given (its annotation), or None."""

    @property
    def complete(self) -> bool:
        return (
            self.observed_generation >= self.generation
            and self.updated >= self.replicas
            and self.available >= self.replicas
        )


@dataclass(frozen=True)
class NodeCacheStep:
    """Where the node-local copies of the staged artifact stand (``node_cache_plan``)."""

    status: NodeCacheStatus
    condition: tuple[Literal["True", "False"], str, str]
    """``NodeCached``: (status, reason, message)."""
    roll: bool
    """The copies are ready, or the deadline passed: the workload may roll."""
    create: tuple[KubeObject, ...] = ()
    """Copy Jobs to create."""
    replace: tuple[str, ...] = ()
    """Succeeded copy Jobs of chosen nodes that lost their copy: deleted; a later pass,
    seeing no Job there, creates the new one."""
    copy: HeldCopy | None = None
    """The copy the serving pods mount (a volume of its content); None: the roll goes
    without the node-cache volume (no chosen node holds a copy, the deadline passed)."""


@dataclass(frozen=True)
class EngineCacheStep:
    """Where the engine cache of the desired artifact stands (``engine_cache_plan``)."""

    status: EngineCacheStatus | None
    condition: tuple[Literal["True", "False"], str, str]
    """``EngineCached``: (status, reason, message)."""
    roll: bool
    """Captured, failed, unavailable or past the deadline: the workload may roll."""
    create: KubeObject | None = None
    """The capture Job to create (``plan_capture_job``'s)."""
    use: EngineCacheUse | None = None
    """What the serving pods are given, once captured."""


@dataclass(frozen=True)
class Observed:
    generation: int
    now: datetime
    job: JobObservation | None = None
    workload: WorkloadObservation | None = None
    findings: Sequence[Finding] = field(default_factory=tuple)
    node_cache_enabled: bool = False
    """``spec.nodeCache.enabled``: the roll waits for ``node_cache``."""
    node_cache: NodeCacheStep | None = None
    engine_cache_enabled: bool = False
    """``spec.engineCache.enabled``: the roll waits for ``engine_cache``."""
    engine_cache: EngineCacheStep | None = None


def observe_job(job: KubeObject, termination_message: str = "") -> JobObservation:
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


def staging_progress(job: KubeObject, pods: Sequence[KubeObject], log_tail: str = "") -> str:
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


def observe_workload(
    workload: KubeObject, failing: Sequence[str] = (), pods: Sequence[KubeObject] = ()
) -> WorkloadObservation:
    """Reads a workload's rollout progress from its status (a LeaderWorkerSet's also from its
    leader pods, ``pods``: ``_lws_progress``)."""
    template = serving_template(workload)
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    digest = annotations.get(DIGEST_ANNOTATION)
    generation = int((workload.get("metadata") or {}).get("generation", 1))
    progress = (
        _lws_progress(workload, digest, generation, pods)
        if kind_of(workload).kind == "LeaderWorkerSet"
        else _progress(workload)
    )
    return WorkloadObservation(
        digest=digest,
        generation=generation,
        failing=tuple(failing),
        node_cache=any(
            v.get("name") == VOLUME_NODE_CACHE
            for v in (template.get("spec") or {}).get("volumes") or []
        ),
        engine_cache=annotations.get(ENGINE_CACHE_ANNOTATION),
        **progress,
    )


def _progress(workload: KubeObject) -> dict[str, Any]:
    """A Deployment's or StatefulSet's: its controller's counts for ``observedGeneration``."""
    status = workload.get("status") or {}
    stalled = any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in status.get("conditions") or []
    )
    return {
        "observed_generation": int(status.get("observedGeneration", 0)),
        "replicas": replicas(workload),
        "updated": int(status.get("updatedReplicas", 0)),
        "available": int(status.get("availableReplicas", status.get("readyReplicas", 0))),
        "stalled": stalled,
    }


def _lws_progress(
    workload: KubeObject, digest: str | None, generation: int, pods: Sequence[KubeObject]
) -> dict[str, Any]:
    """A LeaderWorkerSet's. Its status has no ``observedGeneration`` (nor do its conditions):
    right after a patch it still describes the previous templates. So a group counts as
    updated only when its leader pod carries the template's digest (the LWS controller makes
    pods of the new template only once it saw it) and the set's ``updatedReplicas`` agrees,
    and as available only when that leader pod is Ready and the set's ``readyReplicas`` and
    conditions agree (``Available`` true, no ``UpdateInProgress``: groups ready with their
    workers). There is no progress deadline: a roll that never ends is not ``stalled``; its
    failing pods are what rolls back."""
    status = workload.get("status") or {}
    conditions = {c.get("type"): c.get("status") == "True" for c in status.get("conditions") or []}
    groups = replicas(workload)
    leaders = [
        p
        for p in pods
        if (p.get("metadata") or {}).get("labels", {}).get(LWS_WORKER_INDEX_LABEL) == "0"
        and ((p.get("metadata") or {}).get("annotations") or {}).get(DIGEST_ANNOTATION) == digest
        and not (p.get("metadata") or {}).get("deletionTimestamp")
    ]
    ready_leaders = sum(1 for p in leaders if _pod_ready(p))
    settled = conditions.get("Available", False) and not conditions.get("UpdateInProgress", False)
    return {
        "observed_generation": generation,
        "replicas": groups,
        "updated": min(len(leaders), int(status.get("updatedReplicas", 0))),
        "available": min(ready_leaders, int(status.get("readyReplicas", 0))) if settled else 0,
        "stalled": False,
    }


def _pod_ready(pod: KubeObject) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
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


def _terminations(pod: KubeObject, container: str) -> list[KubeObject]:
    status = pod.get("status") or {}
    out: list[KubeObject] = []
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != container:
            continue
        for key in ("state", "lastState"):
            terminated = (cs.get(key) or {}).get("terminated")
            if terminated:
                out.append(terminated)
    return out


def termination_message(
    pods: Sequence[KubeObject], *, success: bool, container: str = STAGER_CONTAINER
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


def pod_failures(pods: Sequence[KubeObject], digest: str | None) -> tuple[str, ...]:
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


def parse_capture(message: str) -> Mapping[str, Any] | None:
    """``capture-engine-cache``'s one-line JSON summary (its last line) when it names the key,
    the serving configuration and the hardware class it captured for, or None."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    try:
        summary = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        return None
    wanted = ("key", "config", "hardware")
    if not isinstance(summary, dict) or not all(k in summary for k in wanted):
        return None
    if not isinstance(summary["config"], dict) or not isinstance(summary["hardware"], dict):
        return None
    return summary


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)
