"""One reconciliation of one ModelDeployment: observe, decide, write the status, act.

``Reconciler._once`` is those four phases, each in its own module: ``observe.py`` reads the
cluster into a ``World`` (the spec's findings, the source's resolution, the workload and its
claim, the staging Jobs, with node caching the nodes, their agents' reports and the copy
Jobs); ``state.decide`` (pure) decides, plus retention and a stager slot here; ``act.py``
writes the status, then executes the one action. Nothing is kept in memory between calls
(but which serving pods a counter has counted), so a restarted operator continues from what
the cluster says.

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

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from modelstage.api.kube_client import Conflict, KubeClient
from modelstage.api.modeldeployment import ModelDeploymentSpec, ModelDeploymentStatus
from modelstage.api.objects import KubeObject
from modelstage.core import node_cache as nc
from pydantic import ValidationError

from . import metrics
from .act import Actor, EventFn, Logger
from .job_plan import stage_job_name
from .node_cache_plan import DEFAULT_COPY_DEADLINE_SECONDS
from .observe import Observer, World, md_path
from .retention import Holder, RetentionPlan, plan_release, plan_retention, remember
from .slots import StagerSlots
from .state import Action, Decision, decide, queued

CONFLICT_ATTEMPTS = 3


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
        self.slots = slots or StagerSlots(0)
        self.node_cache = node_cache
        """Node caching is installed: without it no Node, NodeCache or PV is read."""
        images = (stager_image, *allowed_images)
        self.observer = Observer(
            kube,
            stager_image=stager_image,
            images=images,
            resolve_interval=resolve_interval,
            stager_logs=stager_logs,
            node_cache=node_cache,
            copy_deadline_seconds=copy_deadline_seconds,
        )
        self.actor = Actor(
            kube,
            stager_image=stager_image,
            images=images,
            post_event=post_event,
            slots=self.slots,
            node_cache=node_cache,
            node_cache_root=node_cache_root,
        )
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, namespace: str, name: str, logger: Logger) -> Outcome | None:
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

    def _once(self, namespace: str, name: str, logger: Logger) -> Outcome | None:
        """Observe, decide, write the status, act (the order the module docstring explains)."""
        body = self.kube.get(md_path(namespace, name))
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        world = self.observer.observe(namespace, name, body)
        decision = self._decide(world, logger)
        outcome = Outcome(decision, invalid=world.invalid)
        outcome.status_written = self.actor.write_status(world, decision)
        cache = decision.status.node_cache
        metrics.NODE_CACHE_NODES.set(
            namespace, name, [n.state for n in cache.nodes] if cache is not None else None
        )
        if decision.details:
            logger.info(
                decision.details,
                extra={"action": decision.action.value, "phase": decision.status.phase},
            )
        self.actor.act(world, decision, logger)
        return outcome

    def _decide(self, world: World, logger: Logger) -> Decision:
        """``decide``, then retention's trimmed history, then a stager slot for a new Job."""
        namespace, name = world.owner.namespace, world.owner.name
        observed = world.observed(self.node_cache)
        decision = decide(world.desired, world.status, observed, world.source)
        if world.spec is not None:
            decision = self._retain(world, decision, logger)
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

    def _retain(self, world: World, decision: Decision, logger: Logger) -> Decision:
        """Retention, before the status write: the clean-up Jobs first (by deterministic
        names, so a rerun after a conflict or a crash finds them), then the trimmed history
        goes out with the status."""
        spec, desired = world.spec, world.desired
        assert spec is not None
        namespace, name = world.owner.namespace, world.owner.name
        status = remember(decision.status)
        wants = desired.location.uri if desired is not None else None
        own = Holder(status, spec.retention.keep, wants)
        if not status.artifacts[spec.retention.keep :]:
            return replace(decision, status=status)
        holders = self.observer.holders(namespace, exclude=name)
        plan = plan_retention(own, holders)
        self.actor.clean_up(spec, namespace, name, plan, [own, *holders], world.body, logger)
        return replace(decision, status=status.model_copy(update={"artifacts": list(plan.history)}))

    def release(
        self, namespace: str, name: str, body: KubeObject, logger: Logger
    ) -> RetentionPlan | None:
        """The ModelDeployment is being deleted (its finalizer): clean up every artifact it
        referenced that no other ModelDeployment references, unless ``onDelete: Retain``.
        None when nothing is to be done."""
        with self._lock(namespace, name):
            self.observer.forget(namespace, name)
            status = ModelDeploymentStatus.model_validate(body.get("status") or {})
            try:
                spec = ModelDeploymentSpec.model_validate(body.get("spec") or {})
            except ValidationError:
                logger.info("invalid spec: artifacts of %s are retained", name)
                return None
            if spec.retention.on_delete == "Retain":
                logger.info("retention.onDelete is Retain: artifacts stay on the storage")
                return None
            holders = self.observer.holders(namespace, exclude=name)
            plan = plan_release(Holder(status, 0), holders)
            self.actor.clean_up(spec, namespace, name, plan, holders, body, logger)
            return plan


def _result(outcome: Outcome) -> str:
    if outcome.invalid is not None or outcome.staging_failed:
        return "failed"
    if outcome.decision.action is Action.WAIT and not outcome.status_written:
        return "waiting"
    return "ok"
