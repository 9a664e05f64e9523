"""Act: what ``decide`` returned, sent to the cluster.

The status write (with the ModelDeployment's ``resourceVersion``: a stale read is re-done,
never written) and its Events; then the one action: a resolve Job, a staging Job (with its
PersistentVolumeClaim), the workload's merge patch (with the node-local copy's PV and claim
before it), copy Jobs; and retention's clean-up Jobs. Every object has a deterministic name,
so "already exists" is success and a rerun after a conflict or a crash does nothing twice.
What to send comes from the planners; nothing here decides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from modelstage.api.kube_client import KubeClient, resource_path
from modelstage.api.modeldeployment import ModelDeploymentSpec, ModelDeploymentStatus
from modelstage.api.nodecache import HeldCopy
from modelstage.api.objects import KubeObject, Owner
from modelstage.core import node_cache as nc

from . import metrics
from .artifact import Artifact, artifact_from_status
from .claim_plan import plan_claim
from .engine_cache_plan import ENGINE_CACHE_URI_ANNOTATION
from .job_plan import (
    cleanup_job_name,
    finalize_job_name,
    plan_cleanup_job,
    plan_resolve_job,
    stage_job_name,
)
from .node_cache_plan import NODE_ANNOTATION
from .node_cache_volume import plan_volume
from .observations import observe_job
from .observe import World, md_path, workload_path
from .patch import merge_diff
from .resolve_plan import SourceStep
from .retention import Holder, RetentionPlan
from .rollout_plan import EngineCacheUse, plan_rollout
from .slots import StagerSlots
from .state import Action, Decision
from .validation import image_allowed, opt_in_problem

NODE_CACHE_WARNINGS = ("DeadlinePassed", "CopyFailed", "CopyLost", "NoEligibleNodes")
"""``NodeCached`` reasons posted as Warning events."""
EventFn = Callable[[KubeObject, str, str, str], None]
"""``(object, type, reason, message)``: posts a Kubernetes Event about ``object``."""
Logger = logging.Logger | logging.LoggerAdapter[Any]


class Actor:
    """Writes what the reconciler decided: the status, then the decision's action."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        stager_image: str,
        images: Sequence[str],
        post_event: EventFn,
        slots: StagerSlots,
        node_cache: bool = False,
        node_cache_root: str = nc.DEFAULT_ROOT,
    ) -> None:
        self.kube = kube
        self.stager_image = stager_image
        self.images = tuple(images)
        """Images a spec may name (``spec.stager.image``); the default first."""
        self.post_event = post_event
        self.slots = slots
        self.node_cache = node_cache
        """Node caching is installed: only then are node-local copies' PVs created."""
        self.node_cache_root = node_cache_root

    def write_status(self, world: World, decision: Decision) -> bool:
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

    def _post_transitions(
        self, body: KubeObject, old: ModelDeploymentStatus, decision: Decision
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
                "CaptureFailed",
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

    def act(
        self,
        world: World,
        decision: Decision,
        logger: Logger,
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
            self.create_copy_jobs(world, world.node_cache.create, logger)
        elif decision.action is Action.CREATE_CAPTURE_JOB and world.engine_cache is not None:
            assert world.engine_cache.create is not None
            self._create_capture_job(world, world.engine_cache.create, logger)

    def _create_capture_job(self, world: World, job: KubeObject, logger: Logger) -> None:
        name = job["metadata"]["name"]
        if self.kube.create(resource_path("batch/v1", "jobs", world.owner.namespace), job) is None:
            logger.info("capture Job %s already exists: following it", name)
            return
        uri = job["metadata"]["annotations"][ENGINE_CACHE_URI_ANNOTATION]
        message = f"created capture Job {name} for the engine cache {uri}"
        logger.info(message, extra={"job": name})
        self.post_event(world.body, "Normal", "CaptureJobCreated", message)

    def _create_resolve_job(
        self,
        spec: ModelDeploymentSpec,
        owner: Owner,
        source: SourceStep,
        body: KubeObject,
        logger: Logger,
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

    def _create_job(
        self,
        spec: ModelDeploymentSpec,
        owner: Owner,
        desired: Artifact,
        job: KubeObject,
        body: KubeObject,
        logger: Logger,
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

    def _roll(
        self,
        spec: ModelDeploymentSpec,
        world: World,
        decision: Decision,
        logger: Logger,
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
            engine_cache=_engine_for(world, decision),
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

    def _node_cache_volume(self, owner: Owner, copy: HeldCopy, logger: Logger) -> str:
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

    def create_copy_jobs(
        self,
        world: World,
        jobs: Sequence[KubeObject],
        logger: Logger,
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

    def clean_up(
        self,
        spec: ModelDeploymentSpec,
        namespace: str,
        name: str,
        plan: RetentionPlan,
        holders: list[Holder],
        body: KubeObject,
        logger: Logger,
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


def _engine_for(world: World, decision: Decision) -> EngineCacheUse | None:
    """The captured engine cache the roll gives prepare: only one captured for the artifact
    the roll puts the workload on (a rollback's older artifact gets none)."""
    step = world.engine_cache
    if step is None or step.status is None or step.use is None or decision.artifact is None:
        return None
    return step.use if step.status.digest == decision.artifact.digest else None
