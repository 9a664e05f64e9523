"""One reconciliation of one ModelDeployment: observe, decide, write the status, act.

``_once`` is those four phases: ``_observe`` reads what the planners need (the spec's
findings, the source's resolution, the workload and its claim, the staging Jobs, with node
caching the nodes, their agents' reports and the copy Jobs, turned into observations by
``observe.py`` and ``node_cache_plan.py``), ``_decide`` asks ``state.decide`` (plus retention and a
stager slot), ``_write_status`` writes the status, ``_act`` executes the one action.
Everything decided comes from the planners (``decide``, ``staging_jobs``, ``plan_claim``,
``plan_rollout``, ``plan_node_cache``); this module only reads the objects they need and sends
what they return. Nothing is kept in memory between calls (but which serving pods a counter
has counted), so a restarted operator continues from what the cluster says.

Order of writes, chosen for restart safety:

1. the status (with a ``resourceVersion`` precondition: a stale read is re-done, never written);
2. then the action: create the Job (by its deterministic name: "already exists" is success),
   or send the workload's merge patch (with the workload's ``resourceVersion`` precondition).

Status first matters for a rollback: the status records ``failedDigest`` and the previous
artifact as current before the workload is patched back, so an operator killed between the two
writes redoes the rollback (``decide`` sees the workload off the current artifact) instead of
rolling forward onto the failing artifact again. For a roll-out or a Job it is equally safe:
the planners' plans are no-ops once applied (an empty merge patch is not sent, a Job of that
name is not created twice).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException
from modelstage.api.kube_client import Conflict, KubeClient, resource_path
from modelstage.api.modeldeployment import (
    API_VERSION,
    PLURAL,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    TargetRef,
)
from modelstage.api.nodecache import HeldCopy, NodeCacheObject, NodeCacheReport
from modelstage.api.objects import (
    DIGEST_ANNOTATION,
    LABEL_DIGEST,
    Manifest,
    Owner,
    model_deployment_owners,
)
from modelstage.core import node_cache as nc
from modelstage.core.errors import SpecError
from modelstage.core.formats import AUTO
from modelstage.core.layouts import layout_for
from pydantic import ValidationError

from . import metrics
from .artifact import Artifact, artifact_for, artifact_from_status
from .claim_plan import check_claim_size, plan_claim
from .job_plan import (
    RESOLVE_CONTAINER,
    cleanup_job_name,
    finalize_job_name,
    plan_cleanup_job,
    plan_resolve_job,
    stage_job_name,
    staging_jobs,
    staging_step,
)
from .node_cache_plan import (
    COPY_COMPONENT,
    COPY_CONTAINER,
    DEFAULT_COPY_DEADLINE_SECONDS,
    NODE_ANNOTATION,
    CopyJob,
    PodStart,
    choose_nodes,
    eligible_nodes,
    plan_copy_job,
    plan_node_cache,
    pod_start,
)
from .node_cache_volume import plan_volume
from .observe import (
    JobObservation,
    NodeCacheStep,
    Observed,
    WorkloadObservation,
    observe_job,
    observe_workload,
    pod_failures,
    progress_line,
    staging_progress,
    termination_message,
)
from .patch import merge_diff
from .resolve_plan import (
    SourceStep,
    chosen_format,
    concrete_spec,
    plan_source,
    recorded_identity,
    resolution_due,
    resolve_job_name,
    source_changed,
    source_key,
)
from .retention import Holder, RetentionPlan, plan_release, plan_retention, remember
from .rollout_plan import PREPARE_CONTAINER, plan_rollout
from .serving_version import ServingVersion, recorded_version, serving_version, with_version
from .slots import StagerSlots
from .state import Action, Decision, decide, queued
from .validation import (
    Finding,
    image_allowed,
    opt_in_problem,
    validate_spec,
    validate_workload,
)

STAGER_SELECTOR = {"app.kubernetes.io/component": "stager"}
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""Set by the Job controller on its pods: tells the stage Job's pods from finalize's."""
WORKLOAD_PLURALS = {"Deployment": "deployments", "StatefulSet": "statefulsets"}
CONFLICT_ATTEMPTS = 3
LOG_TAIL_LINES = 20
"""Lines of a running stager's log read for its latest progress line."""
LOG = logging.getLogger(__name__)
NODE_CACHE_WARNINGS = ("DeadlinePassed", "CopyFailed", "CopyLost", "NoEligibleNodes")
"""``NodeCached`` reasons posted as Warning events."""
EventFn = Callable[[Manifest, str, str, str], None]
"""``(object, type, reason, message)``: posts a Kubernetes Event about ``object``."""


def md_path(namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    return resource_path(API_VERSION, PLURAL, namespace, name, subresource)


def workload_path(namespace: str, ref: TargetRef) -> str:
    return resource_path("apps/v1", WORKLOAD_PLURALS[ref.kind], namespace, ref.name)


@dataclass
class Outcome:
    """What one reconciliation did; the kopf handlers turn it into their result."""

    decision: Decision
    invalid: str | None = None
    """Why the spec can never work (for ``kopf.PermanentError``)."""
    status_written: bool = False

    @property
    def staging_failed(self) -> bool:
        staged = self.decision.status.condition("Staged")
        return staged is not None and staged.reason in (
            "StagingFailed",
            "ArtifactMismatch",
            "ResolveFailed",
        )


@dataclass
class _World:
    """What one reconciliation read: the ModelDeployment, and what ``decide`` and the actions
    need to know about the cluster."""

    body: Manifest
    owner: Owner
    status: ModelDeploymentStatus
    now: datetime
    spec: ModelDeploymentSpec | None = None
    """The spec the planners read: ``loadFormat: auto`` decided once the source is known."""
    requested: ModelDeploymentSpec | None = None
    """The spec as written (``auto`` undecided): what resolving reads."""
    invalid: str | None = None
    """Why the spec can never work."""
    findings: list[Finding] = field(default_factory=list)
    source: SourceStep | None = None
    desired: Artifact | None = None
    workload: Manifest | None = None
    observed_workload: WorkloadObservation | None = None
    job: JobObservation | None = None
    """The staging Job followed (``staging_step``)."""
    next_job: Manifest | None = None
    """The staging Job to create next."""
    serving: ServingVersion | None = None
    """The vLLM version staged for, and why (``serving_version.py``)."""
    node_cache: NodeCacheStep | None = None
    """Where the node-local copies of the staged artifact stand (``spec.nodeCache``)."""


def _blocks_staging(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.blocks == "staging"]


def _desired(
    spec: ModelDeploymentSpec, owner: Owner, source: SourceStep, why: str
) -> Artifact | None:
    """The artifact the spec asks for, once its source's identity is known and, for
    ``loadFormat: auto``, its format chosen (``spec`` is the concrete spec then, chosen
    because ``why``)."""
    if source.source is None or spec.load_format == AUTO:
        return None
    artifact = artifact_for(
        spec, namespace=owner.namespace, deployment_name=owner.name, identity=source.source.identity
    )
    return replace(artifact, format_reason=why)


def _plan_artifact(world: _World, requested: ModelDeploymentSpec) -> ModelDeploymentSpec:
    """``loadFormat: auto`` decided by the resolution (every planner reads the concrete
    spec), then the desired artifact; returns the spec the planners read."""
    assert world.source is not None
    chosen = chosen_format(requested, world.source.source)
    world.spec = spec = concrete_spec(requested, chosen) if chosen is not None else requested
    why = chosen.reason if chosen is not None else ""
    world.desired = _desired(spec, world.owner, world.source, why)
    if world.desired is not None and world.serving is not None:
        world.desired = replace(world.desired, vllm_version=world.serving.status())
    return spec


def _with_serving_version(world: _World, spec: ModelDeploymentSpec) -> ModelDeploymentSpec:
    """The spec with the vLLM version to stage for (the spec's, the image tag's or the
    default); one without a layout blocks staging."""
    try:
        world.serving = serving_version(
            spec, world.workload, namespace=world.owner.namespace, deployment_name=world.owner.name
        )
    except SpecError as error:
        world.findings.append(Finding("UnsupportedVllmVersion", str(error), "staging"))
        return spec
    return with_version(spec, world.serving.version)


def _now() -> datetime:
    """Whole seconds: the status round-trips through the API server unchanged."""
    return datetime.now(UTC).replace(microsecond=0)


class Reconciler:
    """Reconciles ModelDeployments; one at a time per object (a lock per name), any number
    of objects in parallel (kopf's worker threads)."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        stager_image: str,
        post_event: EventFn,
        slots: StagerSlots | None = None,
        resolve_interval: float = 0.0,
        stager_logs: bool = False,
        allowed_images: Sequence[str] = (),
        node_cache_root: str = nc.DEFAULT_ROOT,
        node_cache: bool = False,
        copy_deadline_seconds: int = DEFAULT_COPY_DEADLINE_SECONDS,
    ) -> None:
        self.kube = kube
        self.stager_image = stager_image
        self.images = (stager_image, *allowed_images)
        """Images a spec may name (``spec.stager.image``); the default first."""
        self.post_event = post_event
        self.slots = slots or StagerSlots(0)
        self.resolve_interval = resolve_interval
        """Seconds between resolutions of a moving source, when the spec does not say."""
        self.stager_logs = stager_logs
        """Read running stagers' log tails for their progress (needs ``get pods/log``)."""
        self.node_cache_root = node_cache_root
        self.node_cache = node_cache
        """Node caching is installed: without it no Node, NodeCache or PV is read."""
        self.copy_deadline_seconds = copy_deadline_seconds
        self._pod_starts: dict[tuple[str, str], set[str]] = {}
        """Serving pods (uids) whose node cache result is counted, per ModelDeployment."""
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(
        self, namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> Outcome | None:
        """Reads, decides, writes; re-reads and re-decides when a write meets a newer object.
        None when the ModelDeployment is gone. ``Conflict`` when it kept changing."""
        with self._lock(namespace, name):
            for attempt in range(CONFLICT_ATTEMPTS):
                try:
                    outcome = self._once(namespace, name, logger)
                except Conflict as error:
                    if attempt + 1 == CONFLICT_ATTEMPTS:
                        metrics.RECONCILES.labels("conflict").inc()
                        raise
                    logger.debug("write conflict, re-reading: %s", error)
                    continue
                if outcome is not None:
                    metrics.RECONCILES.labels(_result(outcome)).inc()
                return outcome
        raise AssertionError("unreachable")

    def _once(
        self, namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> Outcome | None:
        """Observe, decide, write the status, act (the order the module docstring explains)."""
        body = self.kube.get(md_path(namespace, name))
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        world = self._observe(namespace, name, body)
        decision = self._decide(world, logger)
        outcome = Outcome(decision, invalid=world.invalid)
        outcome.status_written = self._write_status(world, decision)
        cache = decision.status.node_cache
        metrics.NODE_CACHE_NODES.set(
            namespace, name, [n.state for n in cache.nodes] if cache is not None else None
        )
        if decision.details:
            logger.info(
                decision.details,
                extra={"action": decision.action.value, "phase": decision.status.phase},
            )
        self._act(world, decision, logger)
        return outcome

    # -- observe -----------------------------------------------------------------------------

    def _observe(self, namespace: str, name: str, body: Manifest) -> _World:
        """Everything ``decide`` and the actions need, read from the cluster."""
        meta = body["metadata"]
        world = _World(
            body=body,
            owner=Owner(name=name, namespace=namespace, uid=meta["uid"]),
            status=ModelDeploymentStatus.model_validate(body.get("status") or {}),
            now=_now(),
        )
        try:
            world.spec = world.requested = ModelDeploymentSpec.model_validate(
                body.get("spec") or {}
            )
        except ValidationError as error:
            world.invalid = f"spec is invalid: {_first_error(error)}"
            world.findings.append(Finding("InvalidSpec", world.invalid, "staging"))
        if world.spec is not None:
            self._observe_spec(world, world.spec)
        return world

    def _observe_spec(self, world: _World, spec: ModelDeploymentSpec) -> None:
        """A valid spec: its findings, its source's resolution and desired artifact, the
        target workload and its claim, and the staging Jobs of that artifact."""
        namespace, name = world.owner.namespace, world.owner.name
        world.findings += validate_spec(spec, allowed_images=self.images)
        if not _blocks_staging(world.findings):
            try:
                layout_for(spec.serving.vllm_version)
            except SpecError as error:
                world.findings.append(Finding("InvalidSpec", str(error), "staging"))
        world.workload = self.kube.get(workload_path(namespace, spec.serving.target_ref))
        if not _blocks_staging(world.findings):
            spec = _with_serving_version(world, spec)
        if not _blocks_staging(world.findings):
            world.source = self._resolve(spec, world.status, world.owner, world.now)
            spec = _plan_artifact(world, spec)
        blocking = _blocks_staging(world.findings)
        if blocking:
            world.invalid = blocking[0].message
        claim = None
        if spec.storage.pvc is not None and world.desired and world.desired.location.claim_name:
            claim_path = resource_path(
                "v1", "persistentvolumeclaims", namespace, world.desired.location.claim_name
            )
            claim = self.kube.get(claim_path)
        world.findings += validate_workload(
            spec, world.workload, namespace=namespace, deployment_name=name, claim=claim
        )
        too_small = check_claim_size(spec, claim)
        if too_small is not None:  # before any Job starts (claim_plan.py: what is knowable)
            world.findings.append(too_small)
            world.invalid = world.invalid or too_small.message
        if world.desired is not None:
            self._observe_staging(world, spec)
        if world.workload is not None:
            world.observed_workload = self._observe_workload(namespace, world.workload)
        if spec.node_cache.enabled and self.node_cache:
            self._observe_node_cache(world, spec)
        elif spec.node_cache.enabled:
            world.findings.append(Finding("NodeCacheNotInstalled", NOT_INSTALLED, "nothing"))

    def _observe_staging(self, world: _World, spec: ModelDeploymentSpec) -> None:
        """The staging Jobs of the desired artifact; a source that changed between resolving
        and staging is resolved again at once: a new identity is a new artifact, with Jobs of
        its own."""
        self._follow_jobs(world, spec)
        if world.source is None or world.job is None:
            return
        if not source_changed(world.job, world.status.source):
            return
        assert world.requested is not None
        world.source = self._resolve(
            world.requested, world.status, world.owner, world.now, stale=True
        )
        recorded = world.status.source.identity if world.status.source else None
        if world.source.source is None or world.source.source.identity == recorded:
            return
        spec = _plan_artifact(world, world.requested)
        if world.desired is not None:
            self._follow_jobs(world, spec)

    def _follow_jobs(self, world: _World, spec: ModelDeploymentSpec) -> None:
        assert world.desired is not None
        jobs = staging_jobs(
            spec,
            owner=world.owner,
            digest=world.desired.digest,
            default_image=self.stager_image,
            source=world.source.source if world.source is not None else None,
        )
        world.job, world.next_job, foreign = self._observe_jobs(
            world.owner.namespace, world.desired.digest, jobs, world.owner
        )
        if foreign is not None:
            world.findings.append(foreign)

    def _observe_node_cache(self, world: _World, spec: ModelDeploymentSpec) -> None:
        """Once the desired artifact is staged and the workload exists: the nodes, the node
        agents' reports, the artifact's copy Jobs and the serving pods' cache results, turned
        into the node cache's step by ``node_cache_plan``."""
        desired, workload, status = world.desired, world.workload, world.status
        if desired is None or workload is None:
            return
        staged = (status.artifact is not None and status.artifact.digest == desired.digest) or (
            world.job is not None and world.job.state == "Succeeded"
        )
        if not staged or status.failed_digest == desired.digest:  # not rolled out again
            return
        digest = desired.digest
        key = (world.owner.namespace, digest)
        pod_spec = ((workload.get("spec") or {}).get("template") or {}).get("spec") or {}
        try:
            reports = self._node_cache_reports()
            nodes = self.kube.list(resource_path("v1", "nodes"))
        except ApiException as error:
            if error.status != 403:
                raise
            # No node is eligible then: the roll waits until the deadline, and says why.
            world.findings.append(Finding("NodeCacheForbidden", _forbidden(error), "nothing"))
            reports, nodes = {}, []
        eligible = eligible_nodes(pod_spec, nodes, reports, world.now)
        jobs = self._copy_jobs(world, digest)
        replicas = int((workload.get("spec") or {}).get("replicas", 1))
        chosen = choose_nodes(
            eligible,
            key,
            mode=spec.node_cache.nodes,
            replicas=replicas,
            reports=reports,
            jobs=jobs,
            before=status.node_cache,
        )
        step, create = plan_node_cache(
            spec.node_cache,
            key,
            before=status.node_cache,
            chosen=chosen,
            reports=reports,
            jobs=jobs,
            replicas=replicas,
            pod_starts=self._pod_starts_of(world, workload, digest),
            now=world.now,
        )
        manifests = tuple(
            plan_copy_job(
                spec,
                desired,
                node,
                owner=world.owner,
                endpoint=str(reports[node].endpoint),
                deadline_seconds=self.copy_deadline_seconds,
                tolerations=pod_spec.get("tolerations") or (),
                default_image=self.stager_image,
            )
            for node in create
        )
        world.node_cache = replace(step, create=manifests)

    def _node_cache_reports(self) -> dict[str, NodeCacheReport]:
        """The node agents' reports by node; none while the NodeCache API is not installed."""
        try:
            objects = self.kube.list(resource_path(nc.API_VERSION, nc.PLURAL))
        except ApiException as error:
            if error.status == 404:
                return {}
            raise
        reports: dict[str, NodeCacheReport] = {}
        for obj in objects:
            try:
                parsed = NodeCacheObject.model_validate(obj)
            except ValidationError as error:  # an agent of another version: not believed
                LOG.debug("unreadable NodeCache %s: %s", obj.get("metadata"), error)
                continue
            if parsed.status is not None:
                reports[str(parsed.metadata.get("name"))] = parsed.status
        return reports

    def _copy_jobs(self, world: _World, digest: str) -> dict[str, CopyJob]:
        """The copy Jobs of ``digest`` in the namespace, by node; a Job no ModelDeployment of
        the namespace owns is reported as failed (its name is predictable)."""
        namespace = world.owner.namespace
        found: dict[str, CopyJob] = {}
        selector = {LABEL_DIGEST: digest, "app.kubernetes.io/component": COPY_COMPONENT}
        for job in self.kube.list(resource_path("batch/v1", "jobs", namespace), selector):
            meta = job.get("metadata") or {}
            node = (meta.get("annotations") or {}).get(NODE_ANNOTATION)
            if not node:
                continue
            name = str(meta.get("name"))
            foreign = self._foreign_job(namespace, job, world.owner)
            if foreign is not None:
                found[node] = CopyJob(node, name, "Failed", foreign.message)
                continue
            state = observe_job(job).state
            message = ""
            if state != "Running":
                pods = self.kube.list(
                    resource_path("v1", "pods", namespace), label_selector={JOB_NAME_LABEL: name}
                )
                success = state == "Succeeded"
                message = termination_message(pods, success=success, container=COPY_CONTAINER)
            found[node] = CopyJob(node, name, state, message)
        return found

    def _pod_starts_of(self, world: _World, workload: Manifest, digest: str) -> list[PodStart]:
        """Hits and misses of the serving pods of ``digest`` (their prepare summaries); each
        pod counted once in ``modelstage_node_cache_pod_starts_total``."""
        selector = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels")
        pods = self.kube.list(
            resource_path("v1", "pods", world.owner.namespace), label_selector=selector
        )
        key = (world.owner.namespace, world.owner.name)
        counted = self._pod_starts.get(key, set())
        seen: set[str] = set()
        starts: list[PodStart] = []
        for pod in pods:
            meta = pod.get("metadata") or {}
            if (meta.get("annotations") or {}).get(DIGEST_ANNOTATION) != digest:
                continue
            start = pod_start(pod, PREPARE_CONTAINER)
            if start is None:
                continue
            starts.append(start)
            uid = str(meta.get("uid"))
            seen.add(uid)
            if uid not in counted:
                metrics.NODE_CACHE_POD_STARTS.labels(start.result).inc()
        self._pod_starts[key] = seen
        return starts

    def _create_copy_jobs(
        self,
        world: _World,
        jobs: Sequence[Manifest],
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        """Deletes the Jobs of nodes that lost their copy (a later pass creates their new
        ones), then creates ``jobs``, each when a stager slot is free."""
        namespace = world.owner.namespace
        path = resource_path("batch/v1", "jobs", namespace)
        for name in world.node_cache.replace if world.node_cache is not None else ():
            if self.kube.delete(resource_path("batch/v1", "jobs", namespace, name)):
                logger.info("its node lost the copy: deleted copy Job %s to copy it again", name)
        for job in jobs:
            name = job["metadata"]["name"]
            node = job["metadata"]["annotations"][NODE_ANNOTATION]
            position = self.slots.acquire((namespace, name), (namespace, world.owner.name))
            if position:
                logger.info("copy Job %s waits for a stager slot (position %d)", name, position)
                continue
            try:
                created = self.kube.create(path, job)
            except BaseException:
                self.slots.finished((namespace, name))
                raise
            if created is None:
                logger.info("copy Job %s already exists: following it", name)
                continue
            message = f"created copy Job {name} for node {node}"
            logger.info(message, extra={"job": name, "node": node})
            self.post_event(world.body, "Normal", "CopyJobCreated", message)

    # -- decide ------------------------------------------------------------------------------

    def _decide(
        self, world: _World, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> Decision:
        """``decide``, then retention's trimmed history, then a stager slot for a new Job."""
        namespace, name = world.owner.namespace, world.owner.name
        observed = Observed(
            generation=int(world.body["metadata"].get("generation", 1)),
            now=world.now,
            job=world.job,
            workload=world.observed_workload,
            findings=tuple(world.findings),
            node_cache_enabled=(
                self.node_cache and world.spec is not None and world.spec.node_cache.enabled
            ),
            node_cache=world.node_cache,
        )
        decision = decide(world.desired, world.status, observed, world.source)
        if world.spec is not None:
            decision = self._retain(
                world.spec, namespace, name, world.desired, decision, world.body, logger
            )
        desired, next_job = world.desired, world.next_job
        if decision.action is Action.CREATE_JOB and desired is not None and next_job is not None:
            job_name = next_job["metadata"]["name"]
            if job_name == stage_job_name(desired.digest):
                position = self.slots.acquire((namespace, job_name), (namespace, name))
                if position:
                    decision = queued(
                        decision, position, self.slots.limit, observed, self.slots.per_namespace
                    )
        return decision

    # -- write the status --------------------------------------------------------------------

    def _write_status(self, world: _World, decision: Decision) -> bool:
        """The status, before any action; whether it was written (it had changed). Diffed
        against what the server holds: a default (phase Pending) not yet written there must
        be written, not taken as already present."""
        raw = world.body.get("status") or {}
        old = {k: v for k, v in world.status.wire().items() if k in raw}
        new = decision.status.wire()
        if old == new:
            return False
        patch = {
            "metadata": {"resourceVersion": world.body["metadata"]["resourceVersion"]},
            "status": merge_diff(old, new),
        }
        self.kube.merge_patch(md_path(world.owner.namespace, world.owner.name, "status"), patch)
        self._post_transitions(world.body, world.status, decision)
        return True

    # -- act ---------------------------------------------------------------------------------

    def _act(
        self,
        world: _World,
        decision: Decision,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        """The one action ``decide`` asked for."""
        spec = world.spec
        if decision.action is Action.CREATE_RESOLVE_JOB and spec is not None:
            assert world.source is not None
            assert world.requested is not None  # auto's resolve Job describes the source
            self._create_resolve_job(world.requested, world.owner, world.source, world.body, logger)
        elif decision.action is Action.CREATE_JOB and spec is not None and world.desired:
            assert world.next_job is not None
            self._create_job(spec, world.owner, world.desired, world.next_job, world.body, logger)
        elif decision.action in (Action.ROLL_OUT, Action.ROLL_BACK):
            assert spec is not None and world.workload is not None
            self._roll(spec, world, decision, logger)
        elif decision.action is Action.CREATE_COPY_JOBS and world.node_cache is not None:
            self._create_copy_jobs(world, world.node_cache.create, logger)

    def _roll(
        self,
        spec: ModelDeploymentSpec,
        world: _World,
        decision: Decision,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        """Patch the workload onto (or back to) the decision's artifact."""
        namespace, workload = world.owner.namespace, world.workload
        assert workload is not None and decision.artifact is not None
        # ``decide`` never asks for this without the opt-in; checked again here, where the
        # operator writes to a workload that is not its own.
        refused = opt_in_problem(workload, namespace=namespace, deployment_name=world.owner.name)
        if refused is not None:
            raise AssertionError(f"refusing to patch: {refused}")
        copy = world.node_cache.copy if world.node_cache is not None else None
        claim = None
        if copy is not None and decision.action is Action.ROLL_OUT and self.node_cache:
            claim = self._node_cache_volume(world.owner, copy, logger)
        plan = plan_rollout(
            spec,
            artifact_from_status(decision.artifact),
            workload,
            default_image=self.stager_image,
            node_cache_claim=claim,
        )
        if not plan.changed:
            return
        patch = dict(plan.merge_patch)
        patch["metadata"] = {
            **(patch.get("metadata") or {}),
            "resourceVersion": plan.resource_version,
        }
        self.kube.merge_patch(workload_path(namespace, spec.serving.target_ref), patch)
        metrics.WORKLOAD_PATCHES.labels(decision.action.value).inc()
        rolled_back = decision.action is Action.ROLL_BACK
        for detail in plan.details:
            logger.info(detail, extra={"action": decision.action.value})
            self.post_event(
                world.body,
                "Warning" if rolled_back else "Normal",
                "RolledBack" if rolled_back else "RolledOut",
                detail,
            )

    def _node_cache_volume(
        self, owner: Owner, copy: HeldCopy, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> str:
        """The PV and the claim of ``owner``'s node-local copy (``node_cache_volume``), before
        the workload names the claim; "already exists" is success (deterministic names)."""
        pv, pvc = plan_volume(owner, copy.content, copy.bytes, root=self.node_cache_root)
        if self.kube.create(resource_path("v1", "persistentvolumes"), pv) is not None:
            logger.info("created PersistentVolume %s for copy %s", pv["metadata"]["name"],
                        copy.content)  # fmt: skip
        path = resource_path("v1", "persistentvolumeclaims", owner.namespace)
        if self.kube.create(path, pvc) is not None:
            logger.info("created PersistentVolumeClaim %s", pvc["metadata"]["name"])
        return str(pvc["metadata"]["name"])

    def _holders(self, namespace: str, exclude: str) -> list[Holder]:
        """Every other ModelDeployment of the namespace, as retention counts references."""
        holders = []
        for body in self.kube.list(md_path(namespace)):
            if body["metadata"]["name"] == exclude:
                continue
            status = ModelDeploymentStatus.model_validate(body.get("status") or {})
            try:
                spec = ModelDeploymentSpec.model_validate(body.get("spec") or {})
                spec = with_version(spec, recorded_version(spec, status.vllm_version))
                identity = recorded_identity(spec, status.source)
                chosen = chosen_format(spec, status.source)
                wants = (
                    artifact_for(
                        concrete_spec(spec, chosen),
                        namespace=namespace,
                        deployment_name=body["metadata"]["name"],
                        identity=identity,
                    ).location.uri
                    if identity is not None and chosen is not None
                    else None  # not resolved yet: it wants nothing staged so far
                )
                holders.append(Holder(status, spec.retention.keep, wants))
            except (ValidationError, SpecError):  # unknown intent: it keeps all it has
                holders.append(Holder(status, len(status.artifacts)))
        return holders

    def _retain(
        self,
        spec: ModelDeploymentSpec,
        namespace: str,
        name: str,
        desired: Artifact | None,
        decision: Decision,
        body: Manifest,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> Decision:
        """Retention, before the status write: the clean-up Jobs first (by deterministic
        names, so a rerun after a conflict or a crash finds them), then the trimmed history
        goes out with the status."""
        status = remember(decision.status)
        wants = desired.location.uri if desired is not None else None
        own = Holder(status, spec.retention.keep, wants)
        if not status.artifacts[spec.retention.keep :]:
            return replace(decision, status=status)
        holders = self._holders(namespace, exclude=name)
        plan = plan_retention(own, holders)
        self._clean_up(spec, namespace, name, plan, [own, *holders], body, logger)
        return replace(decision, status=status.model_copy(update={"artifacts": list(plan.history)}))

    def release(
        self,
        namespace: str,
        name: str,
        body: Manifest,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> RetentionPlan | None:
        """The ModelDeployment is being deleted (its finalizer): clean up every artifact it
        referenced that no other ModelDeployment references, unless ``onDelete: Retain``.
        None when nothing is to be done."""
        with self._lock(namespace, name):
            self._pod_starts.pop((namespace, name), None)  # its serving pods are not ours now
            status = ModelDeploymentStatus.model_validate(body.get("status") or {})
            try:
                spec = ModelDeploymentSpec.model_validate(body.get("spec") or {})
            except ValidationError:
                logger.info("invalid spec: artifacts of %s are retained", name)
                return None
            if spec.retention.on_delete == "Retain":
                logger.info("retention.onDelete is Retain: artifacts stay on the storage")
                return None
            holders = self._holders(namespace, exclude=name)
            plan = plan_release(Holder(status, 0), holders)
            self._clean_up(spec, namespace, name, plan, holders, body, logger)
            return plan

    def _clean_up(
        self,
        spec: ModelDeploymentSpec,
        namespace: str,
        name: str,
        plan: RetentionPlan,
        holders: list[Holder],
        body: Manifest,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        """A clean-up Job per artifact to delete; then the artifact's staging Jobs go, unless
        some ModelDeployment still wants that digest (their names carry only the digest),
        so that asking for it again stages it again instead of finding an old success."""
        wanted = {h.wants.rstrip("/").rsplit("/", 1)[-1] for h in holders if h.wants}
        for artifact in plan.delete:
            connection = spec.storage.s3 if artifact.uri.startswith("s3://") else None
            job = plan_cleanup_job(
                artifact,
                namespace=namespace,
                owner_name=name,
                connection=connection,
                image=self._image(spec),
            )
            if job is None:
                message = (
                    f"artifact {artifact.digest} ({artifact.uri}) is let go, but the spec no "
                    "longer names its S3 connection: delete it by hand"
                )
                logger.warning(message)
                self.post_event(body, "Warning", "ArtifactLeft", message)
                continue
            if self.kube.create(resource_path("batch/v1", "jobs", namespace), job) is not None:
                message = (
                    f"deleting artifact {artifact.digest} ({artifact.uri}): Job "
                    + (job["metadata"]["name"])
                )
                logger.info(message, extra={"digest": artifact.digest})
                self.post_event(body, "Normal", "ArtifactDeleted", message)
            if artifact.digest not in wanted:
                for job_name in (
                    stage_job_name(artifact.digest),
                    finalize_job_name(artifact.digest),
                ):
                    self.kube.delete(resource_path("batch/v1", "jobs", namespace, job_name))
        for artifact in plan.released:
            logger.info("artifact %s let go; another ModelDeployment keeps it", artifact.digest)

    def _image(self, spec: ModelDeploymentSpec) -> str:
        """The spec's stager image when it is allowed, else the operator's default (the
        clean-up runs on deletion too, where no validation stops an image)."""
        wanted = spec.stager.image
        return wanted if wanted and image_allowed(wanted, self.images) else self.stager_image

    def _observe_jobs(
        self, namespace: str, digest: str, planned: list[Manifest], owner: Owner
    ) -> tuple[JobObservation | None, Manifest | None, Finding | None]:
        """(the observation of the Job staging follows, the Job to create next, why an
        existing Job is not followed); see ``staging_step``: the stage Job, then for a
        scaled-out artifact its finalize Job."""
        found: dict[str, Manifest] = {}
        for manifest in planned:
            name = manifest["metadata"]["name"]
            job = self.kube.get(resource_path("batch/v1", "jobs", namespace, name))
            if job is None:
                break
            foreign = self._foreign_job(namespace, job, owner)
            if foreign is not None:
                return None, None, foreign
            found[name] = job
        step = staging_step(
            [j["metadata"]["name"] for j in planned],
            {name: observe_job(job).state for name, job in found.items()},
        )
        if step.create is not None:
            return None, next(j for j in planned if j["metadata"]["name"] == step.create), None
        assert step.follow is not None
        job = found[step.follow]
        state = observe_job(job).state
        pods = self.kube.list(
            resource_path("v1", "pods", namespace),
            label_selector={**STAGER_SELECTOR, LABEL_DIGEST: digest},
        )
        own = [
            p
            for p in pods
            if (p["metadata"].get("labels") or {}).get(JOB_NAME_LABEL) in (None, step.follow)
        ]
        if state == "Running":
            progress = self._progress(namespace, job, own)
            return replace(observe_job(job), progress=progress), None, None
        message = termination_message(own, success=state == "Succeeded")
        return observe_job(job, message), None, None

    def _foreign_job(self, namespace: str, job: Manifest, owner: Owner) -> Finding | None:
        """Why a Job under a staging Job's name is not one to follow: the names are
        predictable, so anyone who may create Jobs could plant one that reports a staged
        artifact. Followed are Jobs controlled by this ModelDeployment or, for an artifact
        two of them share, by another ModelDeployment of the namespace."""
        uids = model_deployment_owners(job)
        if owner.uid in uids:
            return None
        if uids and uids & {
            str(md["metadata"].get("uid")) for md in self.kube.list(md_path(namespace))
        }:
            return None
        name = job["metadata"]["name"]
        return Finding(
            "JobNotOwned",
            f"Job {name} exists in namespace {namespace} but no ModelDeployment of the "
            "namespace owns it: modelstage did not create it and does not trust what it "
            "reports; delete it and modelstage creates its own",
            "staging",
        )

    def _progress(self, namespace: str, job: Manifest, pods: list[Manifest]) -> str:
        """What the cluster says about a running stage Job (``staging_progress``), and with
        ``stager_logs`` the stager's own latest progress line from the tail of its log: the
        stager holds no API credentials to report it any other way."""
        tail = ""
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        for pod in sorted(running, key=lambda p: str(p["metadata"].get("name"))):
            if not self.stager_logs:
                break
            path = resource_path("v1", "pods", namespace, pod["metadata"]["name"], "log")
            try:
                tail = self.kube.text(
                    path, {"container": "stager", "tailLines": str(LOG_TAIL_LINES)}
                )
            except (ApiException, OSError) as error:  # no kubelet, no rights: no line
                LOG.debug("cannot read %s: %s", path, error)
                continue
            if progress_line(tail):
                break
        return staging_progress(job, pods, tail)

    def _resolve(
        self,
        spec: ModelDeploymentSpec,
        status: ModelDeploymentStatus,
        owner: Owner,
        now: datetime,
        stale: bool = False,
    ) -> SourceStep:
        """The resolution step (``resolve_plan.plan_source``), with this round's resolve Job
        observed: its state, and once it ended its pod's termination message. A Job of that
        name this ModelDeployment does not own is not believed (its name is predictable)."""
        namespace, name = owner.namespace, owner.name
        spec_interval = spec.model.resolve_interval_seconds
        interval = self.resolve_interval if spec_interval is None else float(spec_interval)
        job_name = resolve_job_name(spec, status.source, name)
        job: JobObservation | None = None
        due = resolution_due(spec, status.source, now=now, interval=interval, stale=stale)
        manifest = (
            self.kube.get(resource_path("batch/v1", "jobs", namespace, job_name)) if due else None
        )
        if manifest is not None and owner.uid not in model_deployment_owners(manifest):
            return SourceStep(
                status.source if status.source and status.source.key == source_key(spec) else None,
                "failed",
                job_name,
                f"Job {job_name} exists but this ModelDeployment does not own it: modelstage "
                "did not create it and does not trust what it reports; delete it",
            )
        if manifest is not None:
            job = observe_job(manifest)
            if job.state != "Running":
                pods = self.kube.list(
                    resource_path("v1", "pods", namespace),
                    label_selector={JOB_NAME_LABEL: job_name},
                )
                message = termination_message(
                    pods, success=job.state == "Succeeded", container=RESOLVE_CONTAINER
                )
                job = observe_job(manifest, message)
        return plan_source(
            spec, status.source, owner=name, now=now, interval=interval, job=job, stale=stale
        )

    def _create_resolve_job(
        self,
        spec: ModelDeploymentSpec,
        owner: Owner,
        source: SourceStep,
        body: Manifest,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        job = plan_resolve_job(
            spec, owner=owner, name=source.job_name, default_image=self.stager_image
        )
        created = self.kube.create(resource_path("batch/v1", "jobs", owner.namespace), job)
        if created is None:
            logger.info("resolve Job %s already exists: following it", source.job_name)
            return
        message = f"created resolve Job {source.job_name} for {spec.model.uri}"
        logger.info(message, extra={"job": source.job_name})
        self.post_event(body, "Normal", "ResolveJobCreated", message)

    def _observe_workload(self, namespace: str, workload: Manifest) -> WorkloadObservation:
        digest = observe_workload(workload).digest
        failing: tuple[str, ...] = ()
        if digest is not None:
            selector = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels")
            pods = self.kube.list(resource_path("v1", "pods", namespace), label_selector=selector)
            failing = pod_failures(pods, digest)
        return observe_workload(workload, failing)

    def _create_job(
        self,
        spec: ModelDeploymentSpec,
        owner: Owner,
        desired: Artifact,
        job: Manifest,
        body: Manifest,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        if job["metadata"]["name"] == stage_job_name(desired.digest):
            cleanup_path = resource_path(
                "batch/v1",
                "jobs",
                owner.namespace,
                cleanup_job_name(desired.digest, desired.location.uri),
            )
            cleanup = self.kube.get(cleanup_path)
            if cleanup is not None and observe_job(cleanup).state == "Running":
                # Staging now would race the delete of the same location; the clean-up
                # Job's events reconcile this ModelDeployment again when it ends.
                logger.info("waiting for clean-up Job %s first", cleanup["metadata"]["name"])
                self.slots.finished((owner.namespace, job["metadata"]["name"]))
                return
            if cleanup is not None:
                self.kube.delete(cleanup_path)
        claim = plan_claim(spec, owner=owner)
        if claim is not None:
            path = resource_path("v1", "persistentvolumeclaims", owner.namespace)
            if self.kube.create(path, claim) is not None:
                logger.info("created PersistentVolumeClaim %s", claim["metadata"]["name"])
        name = job["metadata"]["name"]
        try:
            created = self.kube.create(resource_path("batch/v1", "jobs", owner.namespace), job)
        except BaseException:
            self.slots.finished((owner.namespace, name))  # the reservation, if any
            raise
        if created is None:
            logger.info("stager Job %s already exists: following it", name)
            return
        metrics.JOBS_CREATED.inc()
        message = f"created stager Job {name} for artifact {desired.digest}"
        logger.info(message, extra={"job": name, "digest": desired.digest})
        self.post_event(body, "Normal", "JobCreated", message)

    def _post_transitions(
        self, body: Manifest, old: ModelDeploymentStatus, decision: Decision
    ) -> None:
        """An Event per phase change and per condition whose status or reason changed."""
        new = decision.status
        for cond in new.conditions:
            before = old.condition(cond.type)
            if before is not None and (before.status, before.reason) == (cond.status, cond.reason):
                continue
            if before is None and cond.status != "True" and cond.type == "Degraded":
                continue  # "not degraded" on creation is no news
            warning = (cond.type == "Degraded" and cond.status == "True") or cond.reason in (
                "StagingFailed",
                "ArtifactMismatch",
                "ResolveFailed",
                *NODE_CACHE_WARNINGS,
            )
            self.post_event(
                body,
                "Warning" if warning else "Normal",
                cond.reason,
                f"{cond.type}={cond.status}: {cond.message}"
                if cond.message
                else f"{cond.type}={cond.status}",
            )
        if old.phase != new.phase or old.observed_generation is None:
            self.post_event(
                body,
                "Warning" if new.phase == "Failed" else "Normal",
                f"Phase{new.phase}",
                f"phase {old.phase} -> {new.phase}",
            )


NOT_INSTALLED = (
    "spec.nodeCache.enabled, but node caching is not installed with this operator (the "
    "chart's nodeCache.enabled): the workload rolls without node-local copies"
)


def _forbidden(error: ApiException) -> str:
    return (
        f"node caching: the operator may not read Nodes or NodeCaches ({error.reason}); grant "
        "it get, list and watch on nodes and nodecaches.modelstage.io (the chart does with "
        "nodeCache.enabled); until then no node gets a copy"
    )


def _result(outcome: Outcome) -> str:
    if outcome.invalid is not None or outcome.staging_failed:
        return "failed"
    if outcome.decision.action is Action.WAIT and not outcome.status_written:
        return "waiting"
    return "ok"


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}: {first.get('msg', '')}" if where else str(first.get("msg", ""))
