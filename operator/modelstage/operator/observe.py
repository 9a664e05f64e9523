"""Observe: one ModelDeployment and what the planners need of the cluster, read into a ``World``.

``Observer.observe`` reads the spec's findings, the source's resolution (its resolve Job),
the desired artifact, the target workload and its claim, the staging Jobs, and with node
caching the nodes, their agents' reports, the copy Jobs and the serving pods' cache results.
The objects become observations through the pure functions of ``observations.py`` and the
planners (``resolve_plan``, ``job_plan``, ``node_cache_plan``); ``World.observed`` is what
``state.decide`` is told. Nothing here writes to the cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from kubernetes.client.exceptions import ApiException
from modelstage.api.kube_client import KubeClient, resource_path
from modelstage.api.modeldeployment import (
    API_VERSION,
    PLURAL,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    TargetRef,
)
from modelstage.api.nodecache import NodeCacheObject, NodeCacheReport
from modelstage.api.objects import (
    DIGEST_ANNOTATION,
    LABEL_DIGEST,
    KubeObject,
    Owner,
    model_deployment_owners,
)
from modelstage.core import node_cache as nc
from modelstage.core.errors import SpecError
from modelstage.core.formats import AUTO
from modelstage.core.layouts import layout_for
from pydantic import ValidationError

from . import metrics
from .artifact import Artifact, artifact_for
from .claim_plan import check_claim_size
from .engine_cache_plan import (
    CAPTURE_CONTAINER,
    Unavailable,
    capture_inputs,
    capture_job_name,
    plan_capture_job,
    plan_engine_cache,
)
from .job_plan import RESOLVE_CONTAINER, staging_jobs, staging_step
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
from .observations import (
    EngineCacheStep,
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
from .retention import Holder
from .rollout_plan import PREPARE_CONTAINER
from .serving_version import ServingVersion, recorded_version, serving_version, with_version
from .validation import Finding, validate_spec, validate_workload
from .workload_kinds import KINDS, pod_selector, serving_pod_spec
from .workload_kinds import replicas as workload_replicas

STAGER_SELECTOR = {"app.kubernetes.io/component": "stager"}
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""Set by the Job controller on its pods: tells the stage Job's pods from finalize's."""
LOG_TAIL_LINES = 20
"""Lines of a running stager's log read for its latest progress line."""
LOG = logging.getLogger(__name__)
NOT_INSTALLED = (
    "spec.nodeCache.enabled, but node caching is not installed with this operator (the "
    "chart's nodeCache.enabled): the workload rolls without node-local copies"
)


def md_path(namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    return resource_path(API_VERSION, PLURAL, namespace, name, subresource)


def workload_path(namespace: str, ref: TargetRef) -> str:
    kind = KINDS[ref.kind]
    return resource_path(kind.api_version, kind.plural, namespace, ref.name)


@dataclass
class World:
    """What one reconciliation read: the ModelDeployment, and what ``decide`` and the actions
    need to know about the cluster."""

    body: KubeObject
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
    workload: KubeObject | None = None
    observed_workload: WorkloadObservation | None = None
    job: JobObservation | None = None
    """The staging Job followed (``staging_step``)."""
    next_job: KubeObject | None = None
    """The staging Job to create next."""
    serving: ServingVersion | None = None
    """The vLLM version staged for, and why (``serving_version.py``)."""
    node_cache: NodeCacheStep | None = None
    """Where the node-local copies of the staged artifact stand (``spec.nodeCache``)."""
    engine_cache: EngineCacheStep | None = None
    """Where the staged artifact's engine cache stands (``spec.engineCache``)."""

    def observed(self, node_cache_installed: bool) -> Observed:
        """What ``state.decide`` is told."""
        return Observed(
            generation=int(self.body["metadata"].get("generation", 1)),
            now=self.now,
            job=self.job,
            workload=self.observed_workload,
            findings=tuple(self.findings),
            node_cache_enabled=(
                node_cache_installed and self.spec is not None and self.spec.node_cache.enabled
            ),
            node_cache=self.node_cache,
            engine_cache_enabled=self.spec is not None and self.spec.engine_cache.enabled,
            engine_cache=self.engine_cache,
        )


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


def _plan_artifact(world: World, requested: ModelDeploymentSpec) -> ModelDeploymentSpec:
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


def _with_serving_version(world: World, spec: ModelDeploymentSpec) -> ModelDeploymentSpec:
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


class Observer:
    """Reads the cluster for the reconciler; keeps only which serving pods' node cache
    results it has counted."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        stager_image: str,
        images: Sequence[str],
        resolve_interval: float = 0.0,
        stager_logs: bool = False,
        node_cache: bool = False,
        copy_deadline_seconds: int = DEFAULT_COPY_DEADLINE_SECONDS,
    ) -> None:
        self.kube = kube
        self.stager_image = stager_image
        self.images = tuple(images)
        """Images a spec may name (``spec.stager.image``); the default first."""
        self.resolve_interval = resolve_interval
        """Seconds between resolutions of a moving source, when the spec does not say."""
        self.stager_logs = stager_logs
        """Read running stagers' log tails for their progress (needs ``get pods/log``)."""
        self.node_cache = node_cache
        """Node caching is installed: without it no Node, NodeCache or PV is read."""
        self.copy_deadline_seconds = copy_deadline_seconds
        self._pod_starts: dict[tuple[str, str], set[str]] = {}
        """Serving pods (uids) whose node cache result is counted, per ModelDeployment."""

    def forget(self, namespace: str, name: str) -> None:
        """The ModelDeployment is deleted: its serving pods are not ours now."""
        self._pod_starts.pop((namespace, name), None)

    def observe(self, namespace: str, name: str, body: KubeObject) -> World:
        """Everything ``decide`` and the actions need, read from the cluster."""
        meta = body["metadata"]
        world = World(
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

    def _observe_spec(self, world: World, spec: ModelDeploymentSpec) -> None:
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
            world.source = self.resolve(spec, world.status, world.owner, world.now)
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
        self._observe_caches(world, spec)

    def _observe_caches(self, world: World, spec: ModelDeploymentSpec) -> None:
        """The node-local copies and the engine cache, each when the spec asks for it."""
        if spec.node_cache.enabled and self.node_cache:
            self.observe_node_cache(world, spec)
        elif spec.node_cache.enabled:
            world.findings.append(Finding("NodeCacheNotInstalled", NOT_INSTALLED, "nothing"))
        if spec.engine_cache.enabled:
            self.observe_engine_cache(world, spec)

    def _observe_staging(self, world: World, spec: ModelDeploymentSpec) -> None:
        """The staging Jobs of the desired artifact; a source that changed between resolving
        and staging is resolved again at once: a new identity is a new artifact, with Jobs of
        its own."""
        self._follow_jobs(world, spec)
        if world.source is None or world.job is None:
            return
        if not source_changed(world.job, world.status.source):
            return
        assert world.requested is not None
        world.source = self.resolve(
            world.requested, world.status, world.owner, world.now, stale=True
        )
        recorded = world.status.source.identity if world.status.source else None
        if world.source.source is None or world.source.source.identity == recorded:
            return
        spec = _plan_artifact(world, world.requested)
        if world.desired is not None:
            self._follow_jobs(world, spec)

    def _follow_jobs(self, world: World, spec: ModelDeploymentSpec) -> None:
        assert world.desired is not None
        jobs = staging_jobs(
            spec,
            owner=world.owner,
            artifact=world.desired,
            default_image=self.stager_image,
            source=world.source.source if world.source is not None else None,
        )
        world.job, world.next_job, foreign = self._observe_jobs(
            world.owner.namespace, world.desired.digest, jobs, world.owner
        )
        if foreign is not None:
            world.findings.append(foreign)

    def observe_node_cache(self, world: World, spec: ModelDeploymentSpec) -> None:
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
        pod_spec = serving_pod_spec(workload)
        reports, nodes = self._nodes(world)
        eligible = eligible_nodes(pod_spec, nodes, reports, world.now)
        jobs = self._copy_jobs(world, digest)
        replicas = workload_replicas(workload)
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

    def observe_engine_cache(self, world: World, spec: ModelDeploymentSpec) -> None:
        """Once the desired artifact is staged and the workload exists: the capture's inputs
        (from the workload), its Job and that Job's report, turned into the engine cache's
        step by ``engine_cache_plan``. A Job of the key no ModelDeployment of the namespace
        owns is a failed capture (its name is predictable)."""
        desired, workload, status = world.desired, world.workload, world.status
        if desired is None or workload is None or status.failed_digest == desired.digest:
            return
        staged = (status.artifact is not None and status.artifact.digest == desired.digest) or (
            world.job is not None and world.job.state == "Succeeded"
        )
        if not staged:
            return
        inputs = capture_inputs(spec, desired, workload)
        if isinstance(inputs, Unavailable):
            if inputs.finding:
                world.findings.append(Finding(inputs.reason, inputs.message, "nothing"))
            world.engine_cache = plan_engine_cache(
                spec.engine_cache, desired, inputs, before=status.engine_cache, job=None,
                planned=None, now=world.now,
            )  # fmt: skip
            return
        namespace = world.owner.namespace
        name = capture_job_name(inputs.key(desired.digest))
        manifest = self.kube.get(resource_path("batch/v1", "jobs", namespace, name))
        job: JobObservation | None = None
        if manifest is not None:
            foreign = self._foreign_job(namespace, manifest, world.owner)
            job = (
                JobObservation("Failed", foreign.message, name=name)
                if foreign is not None
                else self._finished(namespace, manifest, CAPTURE_CONTAINER)
            )
        planned = plan_capture_job(
            spec, desired, inputs, owner=world.owner, default_image=self.stager_image
        )
        world.engine_cache = plan_engine_cache(
            spec.engine_cache, desired, inputs, before=status.engine_cache, job=job,
            planned=planned, now=world.now,
        )  # fmt: skip

    def _finished(self, namespace: str, job: KubeObject, container: str) -> JobObservation:
        """A Job's observation with, once it ended, its pod's termination message."""
        state = observe_job(job).state
        if state == "Running":
            return observe_job(job)
        pods = self.kube.list(
            resource_path("v1", "pods", namespace),
            label_selector={JOB_NAME_LABEL: job["metadata"]["name"]},
        )
        message = termination_message(pods, success=state == "Succeeded", container=container)
        return observe_job(job, message)

    def _nodes(self, world: World) -> tuple[dict[str, NodeCacheReport], list[KubeObject]]:
        """The node agents' reports and the nodes; none where the operator may not read
        them (no node is eligible then: the roll waits until the deadline, and says why)."""
        try:
            return self._node_cache_reports(), self.kube.list(resource_path("v1", "nodes"))
        except ApiException as error:
            if error.status != 403:
                raise
            world.findings.append(Finding("NodeCacheForbidden", _forbidden(error), "nothing"))
            return {}, []

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

    def _copy_jobs(self, world: World, digest: str) -> dict[str, CopyJob]:
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
            observed = self._finished(namespace, job, COPY_CONTAINER)
            found[node] = CopyJob(node, name, observed.state, observed.message)
        return found

    def _pod_starts_of(self, world: World, workload: KubeObject, digest: str) -> list[PodStart]:
        """Hits and misses of the serving pods of ``digest`` (their prepare summaries); each
        pod counted once in ``modelstage_node_cache_pod_starts_total``."""
        pods = self.kube.list(
            resource_path("v1", "pods", world.owner.namespace),
            label_selector=pod_selector(workload),
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

    def _observe_jobs(
        self, namespace: str, digest: str, planned: list[KubeObject], owner: Owner
    ) -> tuple[JobObservation | None, KubeObject | None, Finding | None]:
        """(the observation of the Job staging follows, the Job to create next, why an
        existing Job is not followed); see ``staging_step``: the stage Job, then for a
        scaled-out artifact its finalize Job."""
        found: dict[str, KubeObject] = {}
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
            progress = self.progress(namespace, job, own)
            return replace(observe_job(job), progress=progress), None, None
        message = termination_message(own, success=state == "Succeeded")
        return observe_job(job, message), None, None

    def _foreign_job(self, namespace: str, job: KubeObject, owner: Owner) -> Finding | None:
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

    def progress(self, namespace: str, job: KubeObject, pods: list[KubeObject]) -> str:
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

    def resolve(
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
            job = self._finished(namespace, manifest, RESOLVE_CONTAINER)
        return plan_source(
            spec, status.source, owner=name, now=now, interval=interval, job=job, stale=stale
        )

    def _observe_workload(self, namespace: str, workload: KubeObject) -> WorkloadObservation:
        """The workload's rollout, and why pods of its current template fail (a
        LeaderWorkerSet's rollout is read from its pods too: ``observe_workload``)."""
        digest = observe_workload(workload).digest
        if digest is None:
            return observe_workload(workload)
        path = resource_path("v1", "pods", namespace)
        pods = self.kube.list(path, label_selector=pod_selector(workload))
        return observe_workload(workload, pod_failures(pods, digest), pods)

    def holders(self, namespace: str, exclude: str) -> list[Holder]:
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


def _forbidden(error: ApiException) -> str:
    return (
        f"node caching: the operator may not read Nodes or NodeCaches ({error.reason}); grant "
        "it get, list and watch on nodes and nodecaches.modelstage.io (the chart does with "
        "nodeCache.enabled); until then no node gets a copy"
    )


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}: {first.get('msg', '')}" if where else str(first.get("msg", ""))
