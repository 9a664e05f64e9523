"""The kopf handlers: thin triggers of ``Reconciler.reconcile``, nothing more.

Every handler, whatever woke it, reconciles the ModelDeployment(s) concerned from what it
reads back from the cluster (level-triggered), so a missed or repeated event costs one extra
reconciliation and never a wrong action:

- ModelDeployment created, spec updated, operator resumed → reconcile it; kopf retries with
  ``kopf.TemporaryError(delay=...)`` (write conflicts; a failed staging, with a growing
  backoff: no retry storm, the Job is never re-created for the same digest) and stops on
  ``kopf.PermanentError`` (a spec that can never work, with its reason in the status too);
- a stager Job or its pods changed → reconcile the ModelDeployments whose spec asks for
  that digest;
- a resolve Job or its pod changed → reconcile the ModelDeployment whose resolution round it is;
- a target Deployment/StatefulSet/LeaderWorkerSet changed, or a pod of it fails → reconcile
  the ModelDeployments that target it;
- a node agent's ``NodeCache`` report changed, or a copy Job or its pod → reconcile the
  ModelDeployments whose roll waits for node-local copies (and those the node's copies concern);
- an engine-cache capture Job or its pod changed → reconcile the ModelDeployments whose spec
  asks for that digest (the roll waits for the capture);
- a serving pod's prepare reported a node cache hit or miss → reconcile its ModelDeployment;
- a timer, as a safety net for anything missed (``MODELSTAGE_OPERATOR_RESYNC_INTERVAL``).

Run with ``python -m modelstage.operator`` (or ``kopf run -m modelstage.operator.handlers``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import kopf
from modelstage.api.kube_client import Conflict, KubeClient, resource_path
from modelstage.api.modeldeployment import (
    GROUP,
    PLURAL,
    VERSION,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    SourceStatus,
    VllmVersionStatus,
)
from modelstage.api.objects import (
    DIGEST_ANNOTATION,
    LABEL_DIGEST,
    KubeObject,
    model_deployment_owners,
)
from modelstage.core import node_cache as nc

from . import metrics
from .artifact import spec_digest
from .engine_cache_plan import CAPTURE_COMPONENT
from .job_plan import stage_job_name
from .node_cache_plan import COPY_COMPONENT, pod_start
from .node_cache_spec import CacheUse, plan_node_spec, spec_patch
from .node_cache_volume import PV_LABELS, released
from .observations import observe_job, pod_failures
from .observe import JOB_NAME_LABEL
from .reconcile import Outcome, Reconciler
from .resolve_plan import chosen_format, concrete_spec, recorded_identity, resolve_job_name
from .retention import pinned_digests
from .rollout_plan import PREPARE_CONTAINER
from .serving_version import recorded_version, with_version
from .settings import OperatorConfig, configure
from .slots import StagerSlots

MD = (GROUP, VERSION, PLURAL)
MANAGED = {"app.kubernetes.io/managed-by": "modelstage-operator"}
STAGER = {**MANAGED, "app.kubernetes.io/component": "stager"}
STAGE_JOB_PREFIX = stage_job_name("")
CLEANUP = {**MANAGED, "app.kubernetes.io/component": "cleanup"}
RESOLVE = {**MANAGED, "app.kubernetes.io/component": "resolve"}
NODE_COPY = {**MANAGED, "app.kubernetes.io/component": COPY_COMPONENT}
ENGINE_CAPTURE = {**MANAGED, "app.kubernetes.io/component": CAPTURE_COMPONENT}
NODE_CACHES = (nc.API_GROUP, nc.API_VERSION.split("/", 1)[1], nc.PLURAL)
CONFIG = OperatorConfig.from_env()
"""Read at import: the timer's interval is fixed when the handlers are registered."""

Logger = logging.Logger | logging.LoggerAdapter[Any]


class Ref(NamedTuple):
    """What routes child events to a ModelDeployment (kept in a kopf index)."""

    name: str
    digest: str | None
    """The digest its spec asks for (of the source identity its status records)."""
    artifact: str | None
    """The digest its status says the workload is on."""
    target: tuple[str, str] | None
    """(kind, name) of the target workload."""
    resolve_job: str | None = None
    """The resolve Job of its current resolution round."""
    node_cache: str | None = None
    """With node caching on: ``status.nodeCache.phase`` ("" before there is one)."""
    cache_nodes: frozenset[str] = frozenset()
    """The nodes ``status.nodeCache`` lists."""
    pins: frozenset[str] = frozenset()
    """With node caching on: the digests whose node-local copies it pins (``retention``)."""


def _post_event(obj: KubeObject, type_: str, reason: str, message: str) -> None:
    kopf.event(cast(kopf.Body, obj), type=type_, reason=reason, message=message[:1024])


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: Any, logger: Logger, **_: Any) -> None:
    """All operator settings in one place (``settings.py``), then the metrics endpoint and the
    client the handlers share."""
    config = dataclasses.replace(
        OperatorConfig.from_env(), watched_namespaces=getattr(memo, "watched_namespaces", None)
    )
    configure(settings, config)
    metrics.serve(config.metrics_port, config.metrics_host)
    kube = KubeClient.from_environment(timeout=config.request_timeout)
    memo.config = config
    memo.reconciler = Reconciler(
        kube,
        stager_image=config.stager_image,
        post_event=_post_event,
        slots=StagerSlots(config.max_stager_jobs, config.max_stager_jobs_per_namespace),
        allowed_images=config.allowed_stager_images,
        resolve_interval=config.resolve_interval,
        stager_logs=config.stager_logs,
        node_cache_root=config.node_cache_root,
        node_cache=config.node_cache,
        copy_deadline_seconds=config.copy_deadline_seconds,
    )
    logger.info(
        "modelstage operator started",
        extra={"metrics_port": config.metrics_port, "stager_images": config.stager_images},
    )


@kopf.index(*MD)
def modeldeployment_refs(
    namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> dict[str | None, Ref]:
    digest: str | None
    target: tuple[str, str] | None
    resolve_job: str | None
    try:
        parsed = ModelDeploymentSpec.model_validate(dict(spec))
        raw_version = status.get("vllmVersion")
        recorded = VllmVersionStatus.model_validate(raw_version) if raw_version else None
        parsed = with_version(parsed, recorded_version(parsed, recorded))
        raw_source = status.get("source")
        source = SourceStatus.model_validate(raw_source) if raw_source else None
        identity = recorded_identity(parsed, source)
        chosen = chosen_format(parsed, source)
        digest = (
            spec_digest(concrete_spec(parsed, chosen), identity)
            if identity is not None and chosen is not None
            else None
        )
        target = (parsed.serving.target_ref.kind, parsed.serving.target_ref.name)
        resolve_job = resolve_job_name(parsed, source, name)
    except Exception:  # an invalid spec routes nothing; its own handlers report it
        digest, target, resolve_job = None, None, None
    artifact = (status.get("artifact") or {}).get("digest")
    cache = status.get("nodeCache") or {}
    enabled = bool((spec.get("nodeCache") or {}).get("enabled"))
    return {
        namespace: Ref(
            name,
            digest,
            artifact,
            target,
            resolve_job,
            node_cache=str(cache.get("phase") or "") if enabled else None,
            cache_nodes=frozenset(str(n.get("name")) for n in cache.get("nodes") or []),
            pins=_pins(spec, status, digest) if enabled else frozenset(),
        )
    }


def _pins(spec: kopf.Spec, status: kopf.Status, digest: str | None) -> frozenset[str]:
    """``retention.pinned_digests`` of a ModelDeployment; an unreadable one pins every digest
    its status names (its intent is unknown)."""
    try:
        parsed = ModelDeploymentStatus.model_validate(dict(status))
        keep = ModelDeploymentSpec.model_validate(dict(spec)).retention.keep
    except Exception:  # an invalid object: keep what it shows
        every = [status.get("artifact"), status.get("previousArtifact"),
                 *(status.get("artifacts") or [])]  # fmt: skip
        return frozenset(str(a["digest"]) for a in every if isinstance(a, dict) and a.get("digest"))
    return frozenset(pinned_digests(parsed, keep, digest))


def _reconcile(memo: Any, namespace: str, name: str, logger: Logger) -> Outcome | None:
    reconciler: Reconciler = memo.reconciler
    return reconciler.reconcile(namespace, name, logger)


EVENT_CONFLICT_ROUNDS = 5
"""Rounds of re-reads (each of ``reconcile``'s own attempts) an event-triggered reconciliation
makes before it leaves the object to the resync timer."""


def _reconcile_settled(memo: Any, namespace: str, name: str, logger: Logger) -> None:
    """A reconciliation woken by an event, which kopf does not retry: a write conflict means
    someone else wrote the object meanwhile, and that write's event may not wake this object
    again (a Job's or a workload's event does not repeat), so it re-reads after the conflict
    delay instead of dropping the change it was woken for."""
    config: OperatorConfig = memo.config
    for round_ in range(EVENT_CONFLICT_ROUNDS):
        try:
            _reconcile(memo, namespace, name, logger)
            return
        except Conflict as error:
            if round_ + 1 == EVENT_CONFLICT_ROUNDS:
                logger.warning("reconcile of %s left to the resync timer: %s", name, error)
                return
            time.sleep(config.conflict_delay)


@kopf.on.resume(*MD)
@kopf.on.create(*MD)
@kopf.on.update(*MD, field="spec")
def modeldeployment_changed(
    namespace: str | None, name: str, memo: Any, retry: int, logger: Logger, **_: Any
) -> None:
    assert namespace is not None  # a namespaced resource
    config: OperatorConfig = memo.config
    try:
        outcome = _reconcile(memo, namespace, name, logger)
    except Conflict as error:
        raise kopf.TemporaryError(
            f"the object kept changing: {error}", delay=config.conflict_delay
        ) from error
    if outcome is None:
        return
    if outcome.invalid is not None:
        raise kopf.PermanentError(outcome.invalid)
    if outcome.staging_failed:
        staged = outcome.decision.status.condition("Staged")
        reason = staged.message if staged else "staging failed"
        raise kopf.TemporaryError(
            f"{reason} (re-checking; delete the stager Job or change the spec to stage again)",
            delay=config.backoff(retry),
        )


@kopf.timer(*MD, interval=CONFIG.resync_interval, initial_delay=CONFIG.resync_interval, idle=None)
def modeldeployment_resync(
    namespace: str | None, name: str, memo: Any, logger: Logger, **_: Any
) -> None:
    assert namespace is not None
    _reconcile_settled(memo, namespace, name, logger)


@kopf.on.event(*MD)
def modeldeployment_lagging(
    type: str,
    namespace: str | None,
    name: str,
    meta: kopf.Meta,
    status: kopf.Status,
    memo: Any,
    logger: Logger,
    **_: Any,
) -> None:
    """Reconciles a ModelDeployment whose status lags its generation, whatever the event.

    kopf calls the spec handler when the spec differs from the one it last handed to that
    handler; a reconciliation reads the object afresh and may act on a newer spec than the one
    it was handed. An edit back to the handed spec (A, then B read and acted on, then A again
    while the handler still runs) then looks unchanged to kopf, and no handler would run:
    the status would stay on B. Any later event of the object (the status write's own, at
    least) shows the lag, and this reconciles it. Without a lag it does nothing."""
    observed = status.get("observedGeneration")
    generation = meta.get("generation")
    if type == "DELETED" or meta.get("deletionTimestamp") or observed is None:
        return  # gone, going, or never reconciled: the create/resume handlers do it
    if generation is None or int(observed) >= int(generation):
        return
    assert namespace is not None
    _reconcile_settled(memo, namespace, name, logger)


@kopf.on.event(*MD)
def modeldeployment_phase(
    type: str, namespace: str | None, name: str, status: kopf.Status, memo: Any, **_: Any
) -> None:
    assert namespace is not None
    if type == "DELETED":
        metrics.DEPLOYMENTS.forget(namespace, name)
        metrics.NODE_CACHE_NODES.set(namespace, name, None)
        reconciler: Reconciler | None = getattr(memo, "reconciler", None)
        if reconciler is not None:
            reconciler.slots.forget((namespace, name))
    else:
        metrics.DEPLOYMENTS.set(namespace, name, str(status.get("phase") or "Pending"))


def _trace_event(logger: Logger, type_: str | None, meta: Mapping[str, Any]) -> None:
    """Which version of the object an event handler acts on (debug level): the trail to read
    when a change seems missed, and the evidence tests wait for (a version they wrote)."""
    version = meta.get("resourceVersion")
    logger.debug(
        "%s event at resourceVersion %s",
        type_ or "LISTED",
        version,
        extra={"eventType": type_ or "LISTED", "resourceVersion": version},
    )


def _reconcile_matching(
    memo: Any,
    kwargs: dict[str, Any],
    namespace: str | None,
    logger: Logger,
    match: Callable[[Ref], bool],
) -> None:
    """Reconciles each ModelDeployment of ``namespace`` for which ``match(ref)`` holds (write
    conflicts re-read, ``_reconcile_settled``)."""
    refs: kopf.Index[str | None, Ref] = kwargs["modeldeployment_refs"]
    assert namespace is not None
    for ref in list(refs.get(namespace, [])):
        if match(ref):
            _reconcile_settled(memo, namespace, ref.name, logger)


@kopf.on.event("batch", "v1", "jobs", labels=STAGER)
def stage_job_event(
    type: str,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    labels: kopf.Labels,
    memo: Any,
    logger: Logger,
    **kwargs: Any,
) -> None:
    assert namespace is not None
    _trace_event(logger, type, body.get("metadata") or {})
    state = observe_job(dict(body)).state
    if type == "DELETED":
        metrics.JOBS.forget(namespace, name)
    else:
        metrics.JOBS.set(namespace, name, state)
    digest = labels.get(LABEL_DIGEST)
    _reconcile_matching(memo, kwargs, namespace, logger, lambda r: r.digest == digest)
    if not name.startswith(STAGE_JOB_PREFIX):
        return
    slots = cast(Reconciler, memo.reconciler).slots
    if type != "DELETED" and state == "Running" and model_deployment_owners(dict(body)):
        slots.running((namespace, name))
    elif slots.finished((namespace, name)):
        # A slot is free: the queued ModelDeployments try again, in queue order (each
        # also learns its new position).
        for waiting_ns, waiting in slots.waiting():
            _reconcile_settled(memo, waiting_ns, waiting, logger)


@kopf.on.event("batch", "v1", "jobs", labels=CLEANUP)
def cleanup_job_event(
    namespace: str | None, labels: kopf.Labels, memo: Any, logger: Logger, **kwargs: Any
) -> None:
    """A staging of the same location waits for its clean-up Job; this wakes it."""
    digest = labels.get(LABEL_DIGEST)
    _reconcile_matching(memo, kwargs, namespace, logger, lambda r: r.digest == digest)


@kopf.on.event("batch", "v1", "jobs", labels=RESOLVE)
def resolve_job_event(
    name: str, namespace: str | None, memo: Any, logger: Logger, **kwargs: Any
) -> None:
    """A resolve Job started or ended: its ModelDeployment records the identity or the
    failure."""
    _reconcile_matching(memo, kwargs, namespace, logger, lambda r: r.resolve_job == name)


@kopf.on.event("v1", "pods", labels=RESOLVE)
def resolve_pod_event(
    type: str,
    namespace: str | None,
    labels: kopf.Labels,
    status: kopf.Status,
    memo: Any,
    logger: Logger,
    **kwargs: Any,
) -> None:
    """The identity is in the pod's termination message, which can land after the Job's
    condition."""
    if type == "DELETED" or status.get("phase") not in ("Succeeded", "Failed"):
        return
    job = labels.get(JOB_NAME_LABEL) or labels.get("job-name")
    _reconcile_matching(memo, kwargs, namespace, logger, lambda r: r.resolve_job == job)


@kopf.on.delete(*MD)
def modeldeployment_deleted(
    namespace: str | None, name: str, body: kopf.Body, memo: Any, logger: Logger, **_: Any
) -> None:
    """The finalizer: clean up the artifacts only this ModelDeployment referenced (per
    ``retention.onDelete``); the clean-up Jobs run on after the object is gone."""
    assert namespace is not None
    reconciler: Reconciler = memo.reconciler
    plan = reconciler.release(namespace, name, dict(body), logger)
    if plan is not None and plan.details:
        logger.info(plan.details)


@kopf.on.event("v1", "pods", labels=STAGER)
def stager_pod_event(
    type: str,
    namespace: str | None,
    labels: kopf.Labels,
    status: kopf.Status,
    memo: Any,
    logger: Logger,
    **kwargs: Any,
) -> None:
    """A stager pod's termination message can land after its Job's condition."""
    _trace_event(logger, type, kwargs.get("meta") or {})
    if type == "DELETED" or status.get("phase") not in ("Succeeded", "Failed"):
        return
    digest = labels.get(LABEL_DIGEST)
    _reconcile_matching(memo, kwargs, namespace, logger, lambda r: r.digest == digest)


def _targets(kind: str) -> Any:
    def handler(
        type: str,
        namespace: str | None,
        name: str,
        memo: Any,
        logger: Logger,
        **kwargs: Any,
    ) -> None:
        _trace_event(logger, type, kwargs.get("meta") or {})
        _reconcile_matching(memo, kwargs, namespace, logger, lambda r: r.target == (kind, name))

    handler.__name__ = f"{kind.lower()}_event"
    return handler


deployment_event = kopf.on.event("apps", "v1", "deployments", id="deployment_event")(
    _targets("Deployment")
)
statefulset_event = kopf.on.event("apps", "v1", "statefulsets", id="statefulset_event")(
    _targets("StatefulSet")
)
# Where the LeaderWorkerSet API is not installed, kopf logs it as an unresolved resource and
# serves the rest (a cluster-wide operator starts watching once the CRD appears; a namespaced
# one, which may not watch CRDs, on its next start).
leaderworkerset_event = kopf.on.event(
    "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", id="leaderworkerset_event"
)(_targets("LeaderWorkerSet"))


@kopf.on.event("v1", "pods", annotations={DIGEST_ANNOTATION: kopf.PRESENT})
def serving_pod_event(
    type: str,
    body: kopf.Body,
    namespace: str | None,
    annotations: kopf.Annotations,
    memo: Any,
    logger: Logger,
    **kwargs: Any,
) -> None:
    """Two kinds of serving pod matter here (progress shows in the workload's own status):
    a failing one (a rollback may be due), and one whose prepare said whether its node held
    the copy (the node cache's hits and misses)."""
    digest = annotations.get(DIGEST_ANNOTATION)
    if type == "DELETED":
        return
    if pod_failures([dict(body)], digest):
        _reconcile_matching(
            memo, kwargs, namespace, logger, lambda r: digest in (r.artifact, r.digest)
        )
    elif pod_start(dict(body), PREPARE_CONTAINER) is not None:
        _reconcile_matching(
            memo, kwargs, namespace, logger,
            lambda r: r.node_cache is not None and r.digest == digest,
        )  # fmt: skip


WAITING_PHASES = ("Copying", "Warming")
"""``status.nodeCache.phase`` of a roll that waits for the copies. Not "" (no
``status.nodeCache`` yet): the artifact is still staging or the workload is missing, and the
stager Job's or the workload's own events bring that reconciliation, not a heartbeat."""
_reported: dict[str, frozenset[tuple[str, bool, frozenset[tuple[str, str]]]]] = {}
"""Per node, the copies (content, warm, grants) its agent last reported: a heartbeat alone
wakes only the ModelDeployments that wait for copies (whose deadline it may bring)."""


def _held(status: kopf.Status) -> frozenset[tuple[str, bool, frozenset[tuple[str, str]]]]:
    return frozenset(
        (
            str(c.get("content")),
            bool(c.get("warm")),
            frozenset(
                (str(g.get("namespace")), str(g.get("digest"))) for g in c.get("grants") or []
            ),
        )
        for c in status.get("copies") or []
    )


def _cache_uses(refs: kopf.Index[str | None, Ref]) -> list[CacheUse]:
    return [
        CacheUse(
            namespace,
            ref.pins,
            ref.digest if ref.node_cache == nc.WARMING else None,
            ref.cache_nodes,
        )
        for namespace in list(refs)
        if namespace is not None
        for ref in list(refs.get(namespace, []))
        if ref.node_cache is not None
    ]


def node_cache_event(
    type: str,
    name: str,
    spec: kopf.Spec,
    status: kopf.Status,
    memo: Any,
    logger: Logger,
    **kwargs: Any,
) -> None:
    """A node agent reported: its NodeCache's spec is brought up to date (what to keep and
    warm), and ModelDeployments waiting for copies, and those listing the node when its
    copies changed, look again."""
    held = _held(status)
    changed = type == "DELETED" or _reported.get(name) != held
    if type == "DELETED":
        _reported.pop(name, None)
    else:
        _reported[name] = held
    refs: kopf.Index[str | None, Ref] = kwargs["modeldeployment_refs"]
    if type != "DELETED":
        patch = spec_patch(dict(spec), plan_node_spec(name, _cache_uses(refs)))
        if patch is not None:
            reconciler: Reconciler = memo.reconciler
            reconciler.kube.merge_patch(resource_path(nc.API_VERSION, nc.PLURAL, None, name), patch)
    for namespace in list(refs):
        for ref in list(refs.get(namespace, [])):
            if ref.node_cache is None or namespace is None:
                continue
            if ref.node_cache in WAITING_PHASES or (changed and name in ref.cache_nodes):
                _reconcile_settled(memo, namespace, ref.name, logger)


def node_copy_job_event(
    type: str,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    labels: kopf.Labels,
    memo: Any,
    logger: Logger,
    **kwargs: Any,
) -> None:
    """A copy Job changed: it holds a stager slot while it runs; its ModelDeployments look
    again."""
    assert namespace is not None
    slots = cast(Reconciler, memo.reconciler).slots
    state = observe_job(dict(body)).state
    if type != "DELETED" and state == "Running" and model_deployment_owners(dict(body)):
        slots.running((namespace, name))
    elif slots.finished((namespace, name)):
        for waiting_ns, waiting in slots.waiting():
            _reconcile_settled(memo, waiting_ns, waiting, logger)
    node_copy_event(namespace, labels, memo, logger, **kwargs)


def node_copy_event(
    namespace: str | None, labels: kopf.Labels, memo: Any, logger: Logger, **kwargs: Any
) -> None:
    """A copy Job (or its pod: the termination message lands there) changed."""
    digest = labels.get(LABEL_DIGEST)
    _reconcile_matching(
        memo, kwargs, namespace, logger, lambda r: r.node_cache is not None and r.digest == digest
    )


@kopf.on.event("batch", "v1", "jobs", labels=ENGINE_CAPTURE)
@kopf.on.event("v1", "pods", labels=ENGINE_CAPTURE)
def engine_capture_event(
    namespace: str | None, labels: kopf.Labels, memo: Any, logger: Logger, **kwargs: Any
) -> None:
    """A capture Job (or its pod: the termination message lands there) changed."""
    digest = labels.get(LABEL_DIGEST)
    _reconcile_matching(memo, kwargs, namespace, logger, lambda r: r.digest == digest)


def node_cache_volume_event(
    type: str, body: kopf.Body, name: str, memo: Any, logger: Logger, **_: Any
) -> None:
    """A node-cache PV whose claim is gone (its ModelDeployment deleted, the claim removed)
    is deleted: nothing else would, and it names a copy on the nodes. Only PVs of claims in
    namespaces this operator serves: it may read no claim elsewhere (another instance serves
    those, or nobody does, and then nothing of it is this one's to delete)."""
    if type == "DELETED":
        return
    reconciler: Reconciler = memo.reconciler
    ref = (body.get("spec") or {}).get("claimRef") or {}
    if not memo.config.watches(str(ref.get("namespace") or "")):
        return
    claim = None
    if ref.get("namespace") and ref.get("name"):
        path = resource_path("v1", "persistentvolumeclaims", ref["namespace"], ref["name"])
        claim = reconciler.kube.get(path)
    if released(dict(body), claim):
        reconciler.kube.delete(resource_path("v1", "persistentvolumes", None, name))
        logger.info("deleted PersistentVolume %s: its claim is gone", name)


def register_node_cache(enabled: bool) -> None:
    """The handlers of cluster-scoped objects (NodeCaches, PVs) and of copy Jobs, registered
    only with node caching installed: a namespaced operator without it may not watch them,
    and a refused watch would be retried without end."""
    if not enabled:
        return
    kopf.on.event(*NODE_CACHES, id="node_cache_event")(node_cache_event)
    kopf.on.event("batch", "v1", "jobs", labels=NODE_COPY, id="node_copy_job_event")(
        node_copy_job_event
    )
    kopf.on.event("v1", "pods", labels=NODE_COPY, id="node_copy_pod_event")(node_copy_event)
    kopf.on.event("v1", "persistentvolumes", labels=PV_LABELS, id="node_cache_volume_event")(
        node_cache_volume_event
    )


register_node_cache(CONFIG.node_cache)
