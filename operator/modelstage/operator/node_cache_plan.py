"""``pod template + nodes + agents' reports + copy Jobs -> node copies to make, and when to roll``.

With ``spec.nodeCache.enabled``, a staged artifact is copied to the local disks of the nodes
the workload can run on before the workload is rolled onto it. Pure functions of what the kopf
shell read: which nodes are eligible (the pod template's nodeSelector, required node affinity
and tolerations; Ready, schedulable, with a node agent whose ``NodeCache`` report is fresh and
names its copy endpoint), which of them get a copy (the replicas' worth, or all), the copy Job
per node, and each node's state, the phase (Copying, Warming, Ready, DeadlinePassed) and the
``NodeCached`` condition. Nothing here reads the cluster.

A node holds the artifact of ``(namespace, digest)`` when its agent's report lists a copy
granted to that pair (the namespace streamed every byte of it); the copy's content is what the
serving pods' volume names (``node_cache_volume``). A copy Job has no hostPath: it streams the
artifact to its node's agent (``modelstage node-copy``) with a projected token the agent
reviews, and an agent's refusal (no room under its budget, the disk or the namespace's quota)
fails the Job with the agent's words, shown for that node in the status.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from modelstage.api.modeldeployment import (
    DEFAULT_STAGER_IMAGE,
    ModelDeploymentSpec,
    NodeCache,
    NodeCacheStatus,
    NodeCopyStatus,
)
from modelstage.api.nodecache import HeldCopy, NodeCacheReport
from modelstage.api.objects import KubeObject, Owner, labels
from modelstage.core import node_cache as nc

from .artifact import ARTIFACT_MOUNT, Artifact
from .job_plan import _container, _job, _pod_spec
from .kube import SCRATCH_DIR, VOLUME_ARTIFACTS, ca_mount, ca_volume
from .observations import JobState, NodeCacheStep, parse_summary
from .rollout_plan import _s3_serving_env

COPY_COMPONENT = "node-copy"
COPY_CONTAINER = "copy"
LABEL_NODE_COPY = "modelstage.io/node-copy"
"""On a copy Job: a hash of its node's name (node names may be longer than label values)."""
NODE_ANNOTATION = "modelstage.io/node"
HEARTBEAT_MAX_AGE = timedelta(minutes=3)
"""A ``NodeCache`` report older than this (or than ``HEARTBEAT_INTERVALS`` of the agent's
interval, when longer) means the node's agent is gone: no copy goes there."""
HEARTBEAT_INTERVALS = 3
COPY_RESOURCES: KubeObject = {
    "requests": {"cpu": "500m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}
"""A copy streams through bounded buffers (``modelstage node-copy``)."""
COPY_BACKOFF_LIMIT = 3
DEFAULT_COPY_DEADLINE_SECONDS = 3600
"""A copy Job's ``activeDeadlineSeconds`` (chart value ``nodeCache.copyDeadlineSeconds``)."""
TOKEN_VOLUME = "modelstage-node-agent-token"
TOKEN_DIR = "/var/run/secrets/modelstage"
TOKEN_SECONDS = 3600
COPY_TTL_SECONDS = 24 * 3600
"""A finished copy Job stays a day (its pod's message says how it went), then goes by itself;
the copy is known from the agent's report, not from the Job."""

NodeState = Literal["Pending", "Copying", "Ready", "Warm", "Failed"]
HOLDING: frozenset[NodeState] = frozenset({"Ready", "Warm"})


# --- which nodes ------------------------------------------------------------------------------


def _labels(node: KubeObject) -> Mapping[str, str]:
    return (node.get("metadata") or {}).get("labels") or {}


def _name(node: KubeObject) -> str:
    return str((node.get("metadata") or {}).get("name") or "")


def _expression_matches(expression: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    """One node selector requirement (In, NotIn, Exists, DoesNotExist, Gt, Lt) against a
    node's labels or fields, as the scheduler reads it."""
    key, operator = expression.get("key"), expression.get("operator")
    wanted = [str(v) for v in expression.get("values") or []]
    present = key in values
    value = values.get(str(key), "")
    if operator == "In":
        return present and value in wanted
    if operator == "NotIn":
        return not present or value not in wanted
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(wanted) == 1:
        try:
            have, bound = int(value), int(wanted[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _term_matches(term: Mapping[str, Any], node: KubeObject) -> bool:
    """A node selector term: all its requirements hold; a term without any matches nothing."""
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False
    node_fields = {"metadata.name": _name(node)}
    return all(_expression_matches(e, _labels(node)) for e in expressions) and all(
        _expression_matches(f, node_fields) for f in fields
    )


def selects(pod_spec: KubeObject, node: KubeObject) -> bool:
    """Whether the pod's nodeSelector and required node affinity admit ``node`` (any of the
    terms, all of each term's requirements)."""
    node_labels = _labels(node)
    for key, value in (pod_spec.get("nodeSelector") or {}).items():
        if node_labels.get(key) != value:
            return False
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    if not required:
        return True
    return any(_term_matches(t, node) for t in required.get("nodeSelectorTerms") or [])


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    for toleration in tolerations:
        effect = toleration.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        key = toleration.get("key")
        if toleration.get("operator") == "Exists":
            if not key or key == taint.get("key"):
                return True
            continue
        if key == taint.get("key") and (toleration.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


def tolerates(pod_spec: KubeObject, node: KubeObject) -> bool:
    """Whether the pod tolerates every NoSchedule and NoExecute taint of ``node`` (and its
    cordon: ``spec.unschedulable``)."""
    tolerations = pod_spec.get("tolerations") or []
    spec = node.get("spec") or {}
    taints = list(spec.get("taints") or [])
    if spec.get("unschedulable"):
        taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    return all(
        _tolerated(t, tolerations) for t in taints if t.get("effect") in ("NoSchedule", "NoExecute")
    )


def node_ready(node: KubeObject) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def fresh(report: NodeCacheReport | None, now: datetime) -> bool:
    """A report written recently enough that the node's agent is taken to be running."""
    if report is None:
        return False
    interval = timedelta(seconds=report.interval_seconds or 0)
    return report.heartbeat >= now - max(HEARTBEAT_MAX_AGE, HEARTBEAT_INTERVALS * interval)


def eligible_nodes(
    pod_spec: KubeObject,
    nodes: Iterable[KubeObject],
    reports: Mapping[str, NodeCacheReport],
    now: datetime,
) -> list[str]:
    """The nodes the workload's pods may run on that can hold a copy, by name."""
    return sorted(
        _name(node)
        for node in nodes
        if selects(pod_spec, node)
        and tolerates(pod_spec, node)
        and node_ready(node)
        and fresh(reports.get(_name(node)), now)
        and bool(reports[_name(node)].endpoint)
    )


def held_copy(report: NodeCacheReport | None, namespace: str, digest: str) -> HeldCopy | None:
    """The node's complete copy granted to ``(namespace, digest)``; a copy of the same bytes
    that only another namespace proved is not this namespace's."""
    if report is None:
        return None
    for held in report.copies:
        if any(g.namespace == namespace and g.digest == digest for g in held.grants):
            return held
    return None


def holds(report: NodeCacheReport | None, namespace: str, digest: str) -> bool:
    return held_copy(report, namespace, digest) is not None


def chosen_nodes(
    eligible: Sequence[str],
    *,
    mode: Literal["Replicas", "All"],
    replicas: int,
    preferred: Iterable[str] = (),
    avoided: Iterable[str] = (),
) -> list[str]:
    """Which eligible nodes get a copy: all, or the replicas' worth, ``preferred`` ones first
    (those holding the copy or copying it: the choice stays put while copies run), ``avoided``
    ones last (their copy failed or was lost: another node gets one instead), then by name.
    Sorted by name."""
    if mode == "All":
        return sorted(eligible)
    first, last = set(preferred), set(avoided)
    ordered = sorted(eligible, key=lambda n: (0 if n in first else 2 if n in last else 1, n))
    return sorted(ordered[: max(replicas, 0)])


# --- the copy Job -----------------------------------------------------------------------------


def node_hash(node: str) -> str:
    return hashlib.sha256(node.encode()).hexdigest()[:8]


def copy_job_name(digest: str, node: str) -> str:
    """Deterministic per (artifact, node); at most 63 characters."""
    return f"modelstage-copy-{nc.check_digest(digest)}-{node_hash(node)}"


def copy_job_labels(owner_name: str, digest: str, node: str) -> dict[str, str]:
    return {**labels(COPY_COMPONENT, owner_name, digest), LABEL_NODE_COPY: node_hash(node)}


def plan_copy_job(
    spec: ModelDeploymentSpec,
    artifact: Artifact,
    node: str,
    *,
    owner: Owner,
    endpoint: str,
    deadline_seconds: int = DEFAULT_COPY_DEADLINE_SECONDS,
    tolerations: Sequence[KubeObject] = (),
    default_image: str = DEFAULT_STAGER_IMAGE,
) -> KubeObject:
    """The Job that streams ``artifact`` to ``node``'s agent at ``endpoint``: pinned to the
    node, with the workload's tolerations, the artifact mounted read-only as the serving
    pod's prepare initContainer mounts it (the claim, or the S3 settings, credentials and CA
    by reference); no hostPath, no API token, only a projected token for the agent's
    audience; restricted; ended at ``deadline_seconds``."""
    location = artifact.location
    connection = spec.storage.s3 if not location.on_pvc else None
    command = [
        "modelstage", "node-copy",
        "--artifact", location.path,
        "--digest", artifact.digest,
        "--tp", str(artifact.tp),
        "--agent", f"$({nc.ENV_NODE_AGENT})",
        "--token-file", nc.DEFAULT_TOKEN_FILE,
    ]  # fmt: skip
    volumes, mounts = _copy_volumes(artifact)
    env = [
        {"name": "HOME", "value": SCRATCH_DIR},
        {"name": nc.ENV_NODE_AGENT, "value": endpoint},
        *_s3_serving_env(artifact, connection),
    ]
    image = spec.stager.image or default_image
    container = _container(COPY_CONTAINER, image, command, env, [*mounts, *ca_mount(connection)])
    container["resources"] = {k: dict(v) for k, v in COPY_RESOURCES.items()}
    pod_spec = _pod_spec(container, "1Gi", [*volumes, *ca_volume(connection)], None)
    # A projected token needs the account named (the ServiceAccount admission plugin names
    # "default" when it runs; the API server refuses the pod without one when it does not).
    pod_spec["serviceAccountName"] = spec.stager.service_account_name or "default"
    pod_spec["affinity"] = _pinned_to(node)
    if tolerations:
        pod_spec["tolerations"] = [dict(t) for t in tolerations]
    job_labels = copy_job_labels(owner.name, artifact.digest, node)
    job_spec = {
        "backoffLimit": COPY_BACKOFF_LIMIT,
        "activeDeadlineSeconds": deadline_seconds,
        "ttlSecondsAfterFinished": COPY_TTL_SECONDS,
        "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
    }
    annotations = {NODE_ANNOTATION: node, "modelstage.io/artifact-uri": location.uri}
    name = copy_job_name(artifact.digest, node)
    return _job(name, owner.namespace, job_labels, annotations, job_spec, owner)


def _copy_volumes(artifact: Artifact) -> tuple[list[KubeObject], list[KubeObject]]:
    """The copy pod's volumes and mounts: the agent-audience token, and the artifact's claim
    read-only when it is on a PVC."""
    token = {"audience": nc.AGENT_AUDIENCE, "expirationSeconds": TOKEN_SECONDS, "path": "token"}
    volumes: list[KubeObject] = [
        {"name": TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": token}]}}
    ]
    mounts: list[KubeObject] = [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}]
    if artifact.location.on_pvc:
        claim = {"claimName": artifact.location.claim_name, "readOnly": True}
        volumes.append({"name": VOLUME_ARTIFACTS, "persistentVolumeClaim": claim})
        mounts.append({"name": VOLUME_ARTIFACTS, "mountPath": ARTIFACT_MOUNT, "readOnly": True})
    return volumes, mounts


def _pinned_to(node: str) -> KubeObject:
    """An affinity that schedules the pod on ``node`` and nowhere else."""
    match = {"key": "metadata.name", "operator": "In", "values": [node]}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [match]}]
            }
        }
    }


# --- where the copies stand -------------------------------------------------------------------


@dataclass(frozen=True)
class CopyJob:
    """A copy Job of the desired digest, as the shell observed it."""

    node: str
    name: str
    state: JobState
    message: str = ""
    """Its pod's termination message: ``node-copy``'s summary, or why it failed."""


@dataclass(frozen=True)
class PodStart:
    """A serving pod of the desired digest whose prepare initContainer reported on its node's
    cache (its summary's ``nodeCache.result``)."""

    node: str
    result: str


def pod_start(pod: KubeObject, container: str) -> PodStart | None:
    """``hit`` or ``miss`` from a serving pod's prepare summary, with the pod's node."""
    node = (pod.get("spec") or {}).get("nodeName")
    if not node:
        return None
    for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if status.get("name") != container:
            continue
        for key in ("state", "lastState"):
            terminated = (status.get(key) or {}).get("terminated") or {}
            summary = parse_summary(str(terminated.get("message") or ""))
            result = ((summary or {}).get("nodeCache") or {}).get("result")
            if result in (nc.HIT, nc.MISS):
                return PodStart(str(node), str(result))
    return None


def _last_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _node_state(
    node: str,
    key: tuple[str, str],
    report: NodeCacheReport | None,
    job: CopyJob | None,
    before: NodeCopyStatus | None,
) -> tuple[NodeState, str]:
    """One chosen node: holding the copy of ``key`` (namespace, digest), warm or not;
    copying, failed, or still to start. A node that held the copy earlier and no longer does
    lost it (evicted, wiped, or dropped by re-verification)."""
    digest = key[1]
    held = held_copy(report, *key)
    if held is not None:
        return ("Warm" if held.warm else "Ready"), ""
    copied = job is not None and job.state == "Succeeded"
    if copied and before is not None and before.state in (*HOLDING, "Failed"):
        return "Failed", (
            f"{LOST} {digest} (evicted, removed, or dropped by the agent's re-verification): "
            f"Job {copy_job_name(digest, node)} is replaced to copy it again"
        )
    if job is None:
        return "Pending", "the copy Job is to be created"
    if job.state == "Failed":
        why = _last_line(job.message) or "the copy Job failed"
        return "Failed", f"Job {job.name}: {why.removeprefix('error: ')}"
    if job.state == "Succeeded":
        return "Copying", "copied; waiting for the node agent's report"
    # No byte count here: a message that changes with every agent report would rewrite the
    # status on each one (the progress is in the NodeCache report and the agent's metrics).
    return "Copying", f"Job {job.name} copying"


LOST = "the node no longer holds artifact"
"""How a chosen node's status starts once it lost its copy: its Job is replaced."""


def _previous(before: NodeCacheStatus | None, digest: str) -> dict[str, NodeCopyStatus]:
    """The nodes of the last status, when it was of ``digest``."""
    if before is None or before.digest != digest:
        return {}
    return {n.name: n for n in before.nodes}


def choose_nodes(
    eligible: Sequence[str],
    key: tuple[str, str],
    *,
    mode: Literal["Replicas", "All"],
    replicas: int,
    reports: Mapping[str, NodeCacheReport],
    jobs: Mapping[str, CopyJob],
    before: NodeCacheStatus | None,
) -> list[str]:
    """``chosen_nodes`` with each eligible node's state: nodes holding the copy or with a copy
    under way first, nodes whose copy failed or was lost last (a failed Job lingers for a day;
    choosing its node would hold the roll until the deadline)."""
    previous = _previous(before, key[1])
    states = {
        node: _node_state(node, key, reports.get(node), jobs.get(node), previous.get(node))[0]
        for node in eligible
    }
    return chosen_nodes(
        eligible,
        mode=mode,
        replicas=replicas,
        preferred=[n for n, s in states.items() if s in HOLDING or s == "Copying"],
        avoided=[n for n, s in states.items() if s == "Failed"],
    )


def _phase(
    cache: NodeCache,
    before: NodeCacheStatus | None,
    states: Sequence[NodeState],
    deadline_passed: bool,
    idle: bool,
) -> Literal["Copying", "Warming", "Ready", "DeadlinePassed"]:
    """Copying until every chosen node holds the copy, Warming (when asked) until every one
    is warm, then Ready; DeadlinePassed when the deadline came first. Once the workload may
    roll it stays open (Ready, or DeadlinePassed until every copy is there). ``idle``: the
    workload has no replicas and no node was chosen, so nothing is to be waited for."""
    every_held = idle or (bool(states) and all(s in HOLDING for s in states))
    every_warm = idle or (bool(states) and all(s == "Warm" for s in states))
    opened = before is not None and before.phase in ("Ready", "DeadlinePassed")
    if opened and before is not None:
        return "Ready" if before.phase == "Ready" or every_held else "DeadlinePassed"
    if every_held and (not cache.warm or every_warm):
        return "Ready"
    if deadline_passed:
        return "DeadlinePassed"
    return "Warming" if every_held else "Copying"


def _names(nodes: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(nodes[:limit])
    return shown + (f" and {len(nodes) - limit} more" if len(nodes) > limit else "")


def _condition(
    status: NodeCacheStatus,
    states: Mapping[str, tuple[NodeState, str]],
    deadline: datetime,
    idle: bool,
) -> tuple[Literal["True", "False"], str, str]:
    """``NodeCached``: True/Ready once every chosen node holds the copy (or the workload has
    no replicas: no node needs one); else why not, with words that stay the same between
    reconciliations until something changes."""
    digest, wanted, ready = status.digest, status.wanted, status.ready
    if idle and status.phase == "Ready":
        return "True", "Ready", f"the workload has no replicas: no node needs artifact {digest}"
    held = f"{ready}/{wanted} nodes hold artifact {digest}"
    failed = sorted(n for n, (s, _) in states.items() if s == "Failed")
    at = deadline.isoformat().replace("+00:00", "Z")
    if status.phase == "DeadlinePassed" or (status.phase == "Ready" and ready < wanted):
        verb = "rolled" if status.phase == "Ready" else "rolled anyway"
        tail = f"; failed: {_names(failed)}" if failed else ""
        if status.phase == "DeadlinePassed":
            return (
                "False",
                "DeadlinePassed",
                (
                    f"the copies were not ready by {at}: {held}; {verb}: pods on other nodes read "
                    f"the artifact from its storage{tail}"
                ),
            )
        return "False", "CopyLost", f"{held}{tail}"
    if status.phase == "Ready":
        warm = " (warm)" if any(s == "Warm" for s, _ in states.values()) else ""
        return "True", "Ready", held + warm
    if wanted == 0:
        return (
            "False",
            "NoEligibleNodes",
            (
                "no node the workload may run on is Ready with a reporting node agent; the roll "
                f"waits for one until {at}"
            ),
        )
    if failed:
        first = states[failed[0]][1]
        return (
            "False",
            "CopyFailed",
            (
                f"{held}; the copy failed on {_names(failed)} ({failed[0]}: {first}); the roll "
                f"waits for the other nodes until {at}"
            ),
        )
    if status.phase == "Warming":
        warmed = sum(1 for s, _ in states.values() if s == "Warm")
        return (
            "False",
            "Warming",
            (f"{held}; {warmed}/{wanted} read into the page cache; the roll waits until {at}"),
        )
    return "False", "Copying", f"{held}; the roll waits for the copies until {at}"


def served_copy(
    key: tuple[str, str], nodes: Iterable[str], reports: Mapping[str, NodeCacheReport]
) -> HeldCopy | None:
    """The copy the serving pods mount: the content granted to ``key`` that most of
    ``nodes`` hold (one content per spec digest but for a restage in between), None when none
    does (the roll then goes without the node-cache volume)."""
    held = [c for c in (held_copy(reports.get(n), *key) for n in sorted(nodes)) if c is not None]
    if not held:
        return None
    counts = Counter(c.content for c in held)
    content = min(counts, key=lambda c: (-counts[c], c))
    return max((c for c in held if c.content == content), key=lambda c: c.bytes)


def plan_node_cache(
    cache: NodeCache,
    key: tuple[str, str],
    *,
    before: NodeCacheStatus | None,
    chosen: Sequence[str],
    reports: Mapping[str, NodeCacheReport],
    jobs: Mapping[str, CopyJob],
    replicas: int,
    pod_starts: Sequence[PodStart] = (),
    now: datetime,
) -> tuple[NodeCacheStep, list[str]]:
    """The node cache's step (the status, the ``NodeCached`` condition, whether the workload
    may roll, the copy it mounts) and the chosen nodes a copy Job is to be created for, for
    the artifact ``key`` (namespace, digest); a node that lost its copy (its Job succeeded, it
    held the copy, and holds it no more) and is still chosen (no other node took its place)
    gets its Job deleted (``replace``): the next pass creates a new one. Nodes with a copy Job
    of the digest are listed
    whether chosen or not: a failed or lost copy stays known as such after another node was
    chosen in its place."""
    digest = key[1]
    before = before if before is not None and before.digest == digest else None
    since = before.since if before is not None and before.since is not None else now
    deadline = since + timedelta(seconds=cache.deadline_seconds)
    previous = _previous(before, digest)
    idle = replicas <= 0 and not chosen
    states = {
        node: _node_state(node, key, reports.get(node), jobs.get(node), previous.get(node))
        for node in chosen
    }
    phase = _phase(cache, before, [s for s, _ in states.values()], now >= deadline, idle)
    status = NodeCacheStatus(
        digest=digest,
        phase=phase,
        wanted=len(chosen),
        ready=sum(1 for s, _ in states.values() if s in HOLDING),
        since=since,
        nodes=_node_statuses(key, chosen, states, reports, jobs, previous, pod_starts),
    )
    # A lost node's Job is deleted now and created anew by a later pass that sees no Job:
    # that pass writes the node as Pending first, so the new Job's success (before the agent
    # reports the copy) never reads as the old Job's copy lost once more.
    lost = [n for n in chosen if states[n][1].startswith(LOST)]
    create = [n for n in chosen if states[n][0] == "Pending" and n not in jobs]
    step = NodeCacheStep(
        replace=tuple(jobs[n].name for n in lost),
        status=status,
        condition=_condition(status, states, deadline, idle),
        roll=phase in ("Ready", "DeadlinePassed"),
        copy=served_copy(key, [n for n, (s, _) in states.items() if s in HOLDING], reports),
    )
    return step, create


def _node_statuses(
    key: tuple[str, str],
    chosen: Sequence[str],
    states: Mapping[str, tuple[NodeState, str]],
    reports: Mapping[str, NodeCacheReport],
    jobs: Mapping[str, CopyJob],
    previous: Mapping[str, NodeCopyStatus],
    pod_starts: Sequence[PodStart],
) -> list[NodeCopyStatus]:
    """Each node's line in the status: the chosen ones, those with a copy Job, and those
    where serving pods started (their hits and misses)."""
    hits: dict[str, list[int]] = {}
    for start in pod_starts:
        counts = hits.setdefault(start.node, [0, 0])
        counts[0 if start.result == nc.HIT else 1] += 1
    nodes = []
    for node in sorted({*chosen, *hits, *jobs}):
        if node in states:
            state, message = states[node]
        elif holds(reports.get(node), *key):
            state, message = "Ready", "holds the copy (not among the chosen nodes)"
        elif node in jobs:
            report, job = reports.get(node), jobs[node]
            state, message = _node_state(node, key, report, job, previous.get(node))
        else:
            state, message = "Pending", "not among the nodes chosen for a copy"
        hit, miss = hits.get(node, [0, 0])
        nodes.append(NodeCopyStatus(name=node, state=state, message=message, hits=hit, misses=miss))
    return nodes
