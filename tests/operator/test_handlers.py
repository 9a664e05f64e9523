"""The kopf handlers' own decisions (``operator/handlers.py``), without kopf or an API server:
which ModelDeployments each event reconciles, what each reconciliation outcome becomes for
kopf (done, retry later, give up), and what the events feed into the metrics and the stager
slots. The reconciler is a recording stand-in; what it does is tested elsewhere."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
import pytest
from modelstage.api.kube_client import Conflict
from modelstage.api.modeldeployment import ModelDeploymentSpec, SourceStatus
from modelstage.api.objects import DIGEST_ANNOTATION, LABEL_DIGEST
from modelstage.operator import handlers, metrics
from modelstage.operator.artifact import spec_digest
from modelstage.operator.handlers import Ref
from modelstage.operator.resolve_plan import resolve_job_name, source_key
from modelstage.operator.settings import OperatorConfig
from modelstage.operator.slots import StagerSlots

from .conftest import BASE_SPEC

LOG = logging.getLogger("test-handlers")
NS = "team-a"


@dataclass
class Outcome:
    """What the handlers read of ``reconcile.Outcome``."""

    invalid: str | None = None
    staging_failed: bool = False
    staged_message: str | None = None

    @property
    def decision(self) -> Any:
        message = self.staged_message

        class Status:
            def condition(self, type_: str) -> Any:
                assert type_ == "Staged"
                return None if message is None else type("C", (), {"message": message})()

        return type("D", (), {"status": Status()})()


@dataclass
class Reconciler:
    """Records what the handlers ask for; answers with ``outcome`` or raises ``conflicts``."""

    outcome: Outcome | None = None
    conflicts: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)
    slots: StagerSlots = field(default_factory=lambda: StagerSlots(1))

    def reconcile(self, namespace: str, name: str, logger: Any) -> Outcome | None:
        self.calls.append((namespace, name))
        if name in self.conflicts:
            raise Conflict(f"{name} changed")
        return self.outcome


class Memo:
    def __init__(self, reconciler: Reconciler, config: OperatorConfig | None = None) -> None:
        self.reconciler = reconciler
        self.config = config or OperatorConfig()


REFS = [
    Ref("a", digest="d1", artifact="d0", target=("Deployment", "vllm")),
    Ref("b", digest="d2", artifact="d1", target=("StatefulSet", "vllm")),
    Ref("c", digest=None, artifact=None, target=None),  # an invalid spec
]


def index() -> dict[str | None, list[Ref]]:
    return {NS: list(REFS), "elsewhere": [Ref("z", "d1", "d1", ("Deployment", "vllm"))]}


# -- the index -------------------------------------------------------------------------
def test_the_index_routes_a_valid_spec_by_its_digest_status_artifact_and_target() -> None:
    spec = dict(BASE_SPEC)
    parsed = ModelDeploymentSpec.model_validate(spec)
    source = SourceStatus(uri=parsed.model.uri, identity="commit:" + "ab" * 20,
                          resolved_at=datetime(2026, 3, 1, tzinfo=UTC), key=source_key(parsed))  # fmt: skip
    status = {"artifact": {"digest": "abc"}, "source": source.wire()}
    refs = handlers.modeldeployment_refs(namespace=NS, name="m", spec=spec, status=status)
    digest = spec_digest(parsed, source.identity)
    resolve = resolve_job_name(parsed, source, "m")
    assert refs == {NS: Ref("m", digest, "abc", ("Deployment", "vllm-llama"), resolve)}


def test_the_index_routes_an_unresolved_spec_by_its_resolve_job_only() -> None:
    spec = dict(BASE_SPEC)
    refs = handlers.modeldeployment_refs(namespace=NS, name="m", spec=spec, status={})
    resolve = resolve_job_name(ModelDeploymentSpec.model_validate(spec), None, "m")
    assert refs == {NS: Ref("m", None, None, ("Deployment", "vllm-llama"), resolve)}


def test_the_index_routes_nothing_by_digest_or_target_for_an_invalid_spec() -> None:
    spec = {**BASE_SPEC, "parallelism": {"tensor": "two"}}
    refs = handlers.modeldeployment_refs(namespace=NS, name="m", spec=spec, status={})
    assert refs == {NS: Ref("m", None, None, None)}


# -- outcomes -> kopf --------------------------------------------------------------------
def changed(reconciler: Reconciler, retry: int = 0, config: OperatorConfig | None = None) -> None:
    handlers.modeldeployment_changed(
        namespace=NS, name="m", memo=Memo(reconciler, config), retry=retry, logger=LOG
    )


def test_a_done_or_gone_reconciliation_ends_the_handler() -> None:
    changed(Reconciler(outcome=Outcome()))
    changed(Reconciler(outcome=None))


def test_an_invalid_spec_fails_permanently_with_its_reason() -> None:
    with pytest.raises(kopf.PermanentError, match=r"^tensor parallel size 3 does not divide$"):
        changed(Reconciler(outcome=Outcome(invalid="tensor parallel size 3 does not divide")))


def test_a_failed_staging_is_retried_with_a_growing_backoff_naming_the_reason() -> None:
    config = OperatorConfig(failed_backoff=30.0, failed_backoff_max=100.0)
    delays = []
    for retry in range(4):
        with pytest.raises(kopf.TemporaryError) as raised:
            changed(Reconciler(outcome=Outcome(staging_failed=True, staged_message="OOMKilled")),
                    retry=retry, config=config)  # fmt: skip
        assert str(raised.value) == (
            "OOMKilled (re-checking; delete the stager Job or change the spec to stage again)"
        )
        delays.append(raised.value.delay)
    assert delays == [30.0, 60.0, 100.0, 100.0]


def test_a_write_conflict_is_retried_after_the_conflict_delay() -> None:
    with pytest.raises(kopf.TemporaryError, match="the object kept changing: m changed") as raised:
        changed(Reconciler(conflicts={"m"}), config=OperatorConfig(conflict_delay=2.5))
    assert raised.value.delay == 2.5


FAST = OperatorConfig(conflict_delay=0.0)


def test_a_reconciliation_woken_by_an_event_rereads_after_conflicts_then_leaves_it_to_the_timer() -> (
    None
):
    """kopf does not retry event handlers: conflicts are re-read in rounds, never dropped at
    the first; an object that keeps conflicting is left to the next resync."""
    reconciler = Reconciler(conflicts={"m"})
    handlers.modeldeployment_resync(namespace=NS, name="m", memo=Memo(reconciler, FAST), logger=LOG)
    assert reconciler.calls == [(NS, "m")] * handlers.EVENT_CONFLICT_ROUNDS


# -- routing of child events ---------------------------------------------------------------
OWNED = [{"apiVersion": "modelstage.io/v1alpha1", "kind": "ModelDeployment", "name": "a",
          "uid": "u-a", "controller": True}]  # fmt: skip


def job(digest: str, state: str = "Running", owners: list[Any] = OWNED) -> dict[str, Any]:
    conditions = {"Running": [], "Succeeded": [{"type": "Complete", "status": "True"}],
                  "Failed": [{"type": "Failed", "status": "True"}]}[state]  # fmt: skip
    return {"metadata": {"labels": {LABEL_DIGEST: digest}, "ownerReferences": owners},
            "status": {"conditions": conditions}}  # fmt: skip


def stage_job_event(
    reconciler: Reconciler, name: str, body: dict[str, Any], type_: str = "MODIFIED"
) -> None:
    handlers.stage_job_event(
        type=type_, body=body, namespace=NS, name=name, labels=body["metadata"]["labels"],
        memo=Memo(reconciler), logger=LOG, modeldeployment_refs=index(),
    )  # fmt: skip


def test_a_stager_job_event_reconciles_the_deployments_that_ask_for_its_digest() -> None:
    reconciler = Reconciler()
    stage_job_event(reconciler, "modelstage-stage-d1", job("d1"))
    assert reconciler.calls == [(NS, "a")], "by digest, in the Job's namespace only"


def test_a_conflict_on_one_deployment_does_not_stop_the_others() -> None:
    reconciler = Reconciler(conflicts={"a"})
    handlers._reconcile_matching(Memo(reconciler, FAST), {"modeldeployment_refs": index()}, NS,
                                 LOG, lambda r: r.digest is not None)  # fmt: skip
    assert reconciler.calls == [(NS, "a")] * handlers.EVENT_CONFLICT_ROUNDS + [(NS, "b")]


def test_stage_job_events_hold_and_free_stager_slots_and_wake_the_queue() -> None:
    reconciler = Reconciler()
    slots = reconciler.slots
    name = handlers.STAGE_JOB_PREFIX + "d1"
    stage_job_event(reconciler, name, job("d1"))
    assert slots.acquire((NS, "other-job"), (NS, "waiter")) == 1, "the running Job holds the slot"
    reconciler.calls.clear()
    stage_job_event(reconciler, name, job("d1", "Succeeded"))
    assert reconciler.calls == [(NS, "a"), (NS, "waiter")], "the queue is woken once a slot is free"
    reconciler.calls.clear()
    stage_job_event(reconciler, name, job("d1", "Succeeded"), "DELETED")
    assert reconciler.calls == [(NS, "a")], "a slot freed once wakes the queue once"


def test_a_running_job_no_model_deployment_owns_holds_no_slot() -> None:
    """Anyone who may create Jobs can copy the name and labels: only ownership counts."""
    reconciler = Reconciler()
    stage_job_event(reconciler, handlers.STAGE_JOB_PREFIX + "d1", job("d1", owners=[]))
    assert reconciler.slots.acquire((NS, "j"), (NS, "w")) == 0


def test_a_job_that_is_not_a_stage_job_holds_no_slot() -> None:
    reconciler = Reconciler()
    stage_job_event(reconciler, "modelstage-finalize-d1", job("d1"))
    assert reconciler.slots.acquire((NS, "j"), (NS, "w")) == 0


def test_stage_job_events_feed_the_job_gauge() -> None:
    reconciler = Reconciler()
    before = dict(metrics.JOBS._by_object)
    stage_job_event(reconciler, "modelstage-stage-gauge", job("d9", "Failed"))
    assert metrics.JOBS._by_object[(NS, "modelstage-stage-gauge")] == "Failed"
    stage_job_event(reconciler, "modelstage-stage-gauge", job("d9", "Failed"), "DELETED")
    assert metrics.JOBS._by_object == before


def test_a_cleanup_job_event_wakes_the_deployments_of_its_digest() -> None:
    reconciler = Reconciler()
    handlers.cleanup_job_event(namespace=NS, labels={LABEL_DIGEST: "d2"}, memo=Memo(reconciler),
                               logger=LOG, modeldeployment_refs=index())  # fmt: skip
    assert reconciler.calls == [(NS, "b")]


@pytest.mark.parametrize(
    ("type_", "phase", "woken"),
    [("MODIFIED", "Failed", [(NS, "a")]), ("MODIFIED", "Succeeded", [(NS, "a")]),
     ("MODIFIED", "Running", []), ("DELETED", "Failed", [])],
)  # fmt: skip
def test_a_stager_pod_wakes_its_deployments_only_once_it_ended(
    type_: str, phase: str, woken: list[tuple[str, str]]
) -> None:
    reconciler = Reconciler()
    handlers.stager_pod_event(type=type_, namespace=NS, labels={LABEL_DIGEST: "d1"},
                              status={"phase": phase}, memo=Memo(reconciler), logger=LOG,
                              modeldeployment_refs=index())  # fmt: skip
    assert reconciler.calls == woken


@pytest.mark.parametrize(
    ("handler", "kind_name", "woken"),
    [(handlers.deployment_event, "vllm", ["a"]), (handlers.statefulset_event, "vllm", ["b"]),
     (handlers.deployment_event, "other", [])],
)  # fmt: skip
def test_a_workload_event_wakes_the_deployments_that_target_it(
    handler: Any, kind_name: str, woken: list[str]
) -> None:
    reconciler = Reconciler()
    handler(type="MODIFIED", namespace=NS, name=kind_name, memo=Memo(reconciler), logger=LOG,
            modeldeployment_refs=index())  # fmt: skip
    assert reconciler.calls == [(NS, n) for n in woken]


def pod(digest: str, failing: bool) -> dict[str, Any]:
    waiting = {"reason": "CrashLoopBackOff"} if failing else {}
    return {
        "metadata": {"name": "vllm-1", "annotations": {DIGEST_ANNOTATION: digest}},
        "status": {"containerStatuses": [{"name": "vllm", "state": {"waiting": waiting}}]},
    }


@pytest.mark.parametrize(
    ("digest", "failing", "type_", "woken"),
    [("d1", True, "MODIFIED", ["a", "b"]),  # a's spec digest and b's artifact
     ("d0", True, "MODIFIED", ["a"]),  # a's current artifact
     ("d1", False, "MODIFIED", []),  # progress shows in the workload's status
     ("d1", True, "DELETED", [])],
)  # fmt: skip
def test_a_failing_serving_pod_wakes_the_deployments_on_or_going_to_its_artifact(
    digest: str, failing: bool, type_: str, woken: list[str]
) -> None:
    reconciler = Reconciler()
    body = pod(digest, failing)
    handlers.serving_pod_event(type=type_, body=body, namespace=NS,
                               annotations=body["metadata"]["annotations"], memo=Memo(reconciler),
                               logger=LOG, modeldeployment_refs=index())  # fmt: skip
    assert reconciler.calls == [(NS, n) for n in woken]


def test_phase_events_feed_the_deployment_gauge_and_a_deletion_frees_the_queue_place() -> None:
    reconciler = Reconciler()
    reconciler.slots.running((NS, "busy"))
    assert reconciler.slots.acquire((NS, "j"), (NS, "gone")) == 1
    memo = Memo(reconciler)
    handlers.modeldeployment_phase(type="ADDED", namespace=NS, name="gone", status={}, memo=memo)
    assert metrics.DEPLOYMENTS._by_object[(NS, "gone")] == "Pending"
    handlers.modeldeployment_phase(type="MODIFIED", namespace=NS, name="gone",
                                   status={"phase": "Staging"}, memo=memo)  # fmt: skip
    assert metrics.DEPLOYMENTS._by_object[(NS, "gone")] == "Staging"
    handlers.modeldeployment_phase(type="DELETED", namespace=NS, name="gone", status={}, memo=memo)
    assert (NS, "gone") not in metrics.DEPLOYMENTS._by_object
    assert reconciler.slots.waiting() == []


# -- node-cache PVs ----------------------------------------------------------------------------
@dataclass
class Kube:
    """Records the claim reads and PV deletions of the PV handler; no claim exists."""

    reads: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    def get(self, path: str) -> dict[str, Any] | None:
        self.reads.append(path)
        return None

    def delete(self, path: str) -> None:
        self.deleted.append(path)


def bound_pv(namespace: str) -> dict[str, Any]:
    from modelstage.api.objects import Owner
    from modelstage.operator.node_cache_volume import plan_volume

    pv, _ = plan_volume(Owner("llama", namespace, "uid-1"), "0123456789abcdef" * 2, 1)
    pv["spec"]["claimRef"]["uid"] = "claim-1"
    return pv


@pytest.mark.parametrize(
    ("watched", "namespace", "read"),
    [(None, "team-b", True), (("team-a",), "team-a", True), (("team-a",), "team-b", False),
     (("team-*, !team-b",), "team-b", False), (("team-*, !team-b",), "team-c", True)],
)  # fmt: skip
def test_a_node_cache_pv_is_looked_at_only_for_a_claim_in_a_namespace_served(
    watched: tuple[str, ...] | None, namespace: str, read: bool
) -> None:
    """A namespaced operator may read claims only where it serves: a PV of another namespace
    (another instance's, or nobody's) is left alone, neither read nor deleted."""
    kube = Kube()
    reconciler = type("R", (), {"kube": kube})()
    pv = bound_pv(namespace)
    handlers.node_cache_volume_event(
        type="MODIFIED", body=pv, name=pv["metadata"]["name"],
        memo=Memo(reconciler, OperatorConfig(watched_namespaces=watched)), logger=LOG,
    )  # fmt: skip
    claim = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/"
    assert [r.startswith(claim) for r in kube.reads] == ([True] if read else [])
    assert kube.deleted == ([f"/api/v1/persistentvolumes/{pv['metadata']['name']}"] if read else [])
