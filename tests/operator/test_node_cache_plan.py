"""Node caching on the operator's side: which nodes, the copy Job, the per-node states and the
phase, the state machine's wait before the roll, and the roll patch's node-local parts."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
from modelstage.api.modeldeployment import (
    ArtifactStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    NodeCache,
    NodeCacheStatus,
)
from modelstage.api.nodecache import Grant, HeldCopy, NodeCacheReport, PartialCopy
from modelstage.api.objects import Owner
from modelstage.core import node_cache as nc
from modelstage.operator import handlers
from modelstage.operator.artifact import Artifact, artifact_for
from modelstage.operator.node_cache_plan import (
    CopyJob,
    PodStart,
    choose_nodes,
    chosen_nodes,
    copy_job_name,
    eligible_nodes,
    fresh,
    plan_copy_job,
    plan_node_cache,
    pod_start,
    selects,
    tolerates,
)
from modelstage.operator.observations import (
    JobObservation,
    NodeCacheStep,
    Observed,
    WorkloadObservation,
)
from modelstage.operator.patch import apply_merge_patch
from modelstage.operator.rollout_plan import plan_rollout
from modelstage.operator.settings import OperatorConfig
from modelstage.operator.state import Action, decide, headline
from modelstage.operator.validation import Finding, validate_spec

from .conftest import SpecFactory

IDENTITY = "commit:" + "ab" * 20
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OWNER = Owner(name="llama", namespace="llm", uid="uid-1")
ON = {"nodeCache": {"enabled": True}}


def node(
    name: str,
    labels: dict[str, str] | None = None,
    *,
    ready: bool = True,
    taints: list[dict[str, str]] | None = None,
    unschedulable: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"taints": taints or []}
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def content_of(digest: str) -> str:
    """A content address per digest for these tests (the agent computes the real one)."""
    return (digest * 2)[: nc.CONTENT_HEX_CHARS]


def held(digest: str, *, warm: bool = False, namespace: str = "llm") -> HeldCopy:
    content = content_of(digest)
    grant = Grant(namespace=namespace, digest=digest)
    return HeldCopy(
        content=content, label=nc.content_label(content), bytes=100, warm=warm, grants=[grant]
    )


def report(
    node_name: str,
    *digests: str,
    warm: bool = False,
    at: datetime = T0,
    partial: tuple[str, int] | None = None,
    namespace: str = "llm",
) -> NodeCacheReport:
    return NodeCacheReport(
        node=node_name,
        root=nc.DEFAULT_ROOT,
        budget_bytes=10**12,
        heartbeat=at,
        endpoint=f"http://10.0.0.{len(node_name)}:{nc.DEFAULT_COPY_PORT}",
        copies=[held(d, warm=warm, namespace=namespace) for d in digests],
        partial=[PartialCopy(content=content_of(partial[0]), bytes=partial[1])] if partial else [],
    )


def affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
            }
        }
    }


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    out: dict[str, Any] = {"key": key, "operator": operator}
    if values:
        out["values"] = list(values)
    return out


# --- which nodes ------------------------------------------------------------------------------


GPU = node("gpu-1", {"gpu": "h100", "zone": "a", "cores": "64"})


@pytest.mark.parametrize(
    ("pod_spec", "expected"),
    [
        ({}, True),
        ({"nodeSelector": {"gpu": "h100"}}, True),
        ({"nodeSelector": {"gpu": "a100"}}, False),
        ({"nodeSelector": {"gpu": "h100", "zone": "b"}}, False),
        (affinity({"matchExpressions": [expr("gpu", "In", "a100", "h100")]}), True),
        (affinity({"matchExpressions": [expr("gpu", "In", "a100")]}), False),
        (affinity({"matchExpressions": [expr("gpu", "NotIn", "a100")]}), True),
        (affinity({"matchExpressions": [expr("gpu", "NotIn", "h100")]}), False),
        (affinity({"matchExpressions": [expr("other", "NotIn", "x")]}), True),
        (affinity({"matchExpressions": [expr("gpu", "Exists")]}), True),
        (affinity({"matchExpressions": [expr("other", "Exists")]}), False),
        (affinity({"matchExpressions": [expr("other", "DoesNotExist")]}), True),
        (affinity({"matchExpressions": [expr("gpu", "DoesNotExist")]}), False),
        (affinity({"matchExpressions": [expr("cores", "Gt", "32")]}), True),
        (affinity({"matchExpressions": [expr("cores", "Gt", "64")]}), False),
        (affinity({"matchExpressions": [expr("cores", "Lt", "65")]}), True),
        (affinity({"matchExpressions": [expr("gpu", "Gt", "1")]}), False),  # not a number
        (affinity({"matchFields": [expr("metadata.name", "In", "gpu-1")]}), True),
        (affinity({"matchFields": [expr("metadata.name", "NotIn", "gpu-1")]}), False),
        # All requirements of a term, any of the terms; an empty term matches nothing.
        (
            affinity({"matchExpressions": [expr("gpu", "Exists"), expr("zone", "In", "b")]}),
            False,
        ),
        (
            affinity(
                {"matchExpressions": [expr("zone", "In", "b")]},
                {"matchExpressions": [expr("zone", "In", "a")]},
            ),
            True,
        ),
        (affinity({}), False),
        (
            {
                "nodeSelector": {"gpu": "a100"},
                **affinity({"matchExpressions": [expr("gpu", "Exists")]}),
            },
            False,
        ),
    ],
)
def test_node_selector_and_required_affinity_as_the_scheduler_reads_them(
    pod_spec: dict[str, Any], expected: bool
) -> None:
    assert selects(pod_spec, GPU) is expected


NO_SCHEDULE = {"key": "gpu", "value": "true", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("tolerations", "taints", "expected"),
    [
        ([], [], True),
        ([], [NO_SCHEDULE], False),
        ([], [{"key": "gpu", "effect": "NoExecute"}], False),
        ([], [{"key": "gpu", "effect": "PreferNoSchedule"}], True),
        ([{"key": "gpu", "operator": "Equal", "value": "true"}], [NO_SCHEDULE], True),
        ([{"key": "gpu", "value": "false"}], [NO_SCHEDULE], False),
        ([{"key": "gpu", "operator": "Exists"}], [NO_SCHEDULE], True),
        ([{"operator": "Exists"}], [NO_SCHEDULE], True),
        ([{"key": "gpu", "operator": "Exists", "effect": "NoExecute"}], [NO_SCHEDULE], False),
        ([{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}], [NO_SCHEDULE], True),
    ],
)
def test_every_no_schedule_and_no_execute_taint_must_be_tolerated(
    tolerations: list[dict[str, str]], taints: list[dict[str, str]], expected: bool
) -> None:
    assert tolerates({"tolerations": tolerations}, node("n", taints=taints)) is expected


def test_a_cordoned_node_is_not_eligible_unless_tolerated() -> None:
    cordoned = node("n", unschedulable=True)
    assert not tolerates({}, cordoned)
    assert tolerates(
        {"tolerations": [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]},
        cordoned,
    )


def test_eligible_nodes_are_ready_matching_and_have_a_fresh_agent_report() -> None:
    nodes = [
        node("a", {"gpu": "h100"}),
        node("b", {"gpu": "h100"}, ready=False),
        node("c", {"gpu": "h100"}),  # its agent's report is old
        node("d", {"gpu": "h100"}),  # no agent
        node("e", {"gpu": "a100"}),
        node("f", {"gpu": "h100"}),
    ]
    reports = {n: report(n, at=T0 - timedelta(seconds=30)) for n in ("a", "b", "e", "f")} | {
        "c": report("c", at=T0 - timedelta(hours=1))
    }
    assert eligible_nodes({"nodeSelector": {"gpu": "h100"}}, nodes, reports, T0) == ["a", "f"]


def test_a_report_is_fresh_for_three_of_its_agents_intervals_when_that_is_longer() -> None:
    def at(age: timedelta, interval: float | None) -> NodeCacheReport:
        return report("a", at=T0 - age).model_copy(update={"interval_seconds": interval})

    assert fresh(at(timedelta(minutes=2), None), T0)
    assert not fresh(at(timedelta(minutes=4), None), T0)
    assert not fresh(at(timedelta(minutes=4), 10.0), T0)  # three intervals: 30 s, less than 3 min
    assert fresh(at(timedelta(minutes=29), 600.0), T0)
    assert not fresh(at(timedelta(minutes=31), 600.0), T0)
    assert not fresh(None, T0)


def test_replicas_worth_prefers_nodes_holding_or_copying_then_by_name() -> None:
    eligible = ["a", "b", "c", "d"]
    assert chosen_nodes(eligible, mode="Replicas", replicas=2) == ["a", "b"]
    assert chosen_nodes(eligible, mode="Replicas", replicas=2, preferred=["d"]) == ["a", "d"]
    assert chosen_nodes(eligible, mode="Replicas", replicas=9) == eligible
    assert chosen_nodes(eligible, mode="Replicas", replicas=0) == []
    assert chosen_nodes(eligible, mode="All", replicas=1) == eligible
    avoid = {"preferred": ["d"], "avoided": ["a"]}
    assert chosen_nodes(eligible, mode="Replicas", replicas=2, **avoid) == ["b", "d"]
    assert chosen_nodes(eligible, mode="Replicas", replicas=4, **avoid) == eligible


# --- the copy Job -----------------------------------------------------------------------------


@pytest.fixture
def spec(make_spec: SpecFactory) -> ModelDeploymentSpec:
    return make_spec(**ON)


def artifact(spec: ModelDeploymentSpec) -> Artifact:
    return artifact_for(spec, namespace="llm", deployment_name="llama", identity=IDENTITY)


def test_copy_job_is_pinned_to_its_node_and_mounts_the_artifact_read_only(
    spec: ModelDeploymentSpec,
) -> None:
    a = artifact(spec)
    toleration = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    endpoint = "http://10.1.2.3:9103"
    job = plan_copy_job(
        spec, a, "gpu-node-7", owner=OWNER, endpoint=endpoint, deadline_seconds=900,
        tolerations=[toleration],
    )  # fmt: skip
    name = job["metadata"]["name"]
    assert name == copy_job_name(a.digest, "gpu-node-7") and len(name) <= 63
    assert name.startswith(f"modelstage-copy-{a.digest}-")
    assert job["metadata"]["annotations"][nc_node_annotation()] == "gpu-node-7"
    assert job["metadata"]["labels"]["modelstage.io/digest"] == a.digest
    assert job["metadata"]["labels"]["modelstage.io/model-deployment"] == "llama"
    assert len(job["metadata"]["labels"]["modelstage.io/node-copy"]) == 8
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    pod = job["spec"]["template"]["spec"]
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == {
        "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-7"]}]
    }
    assert pod["tolerations"] == [toleration]
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == "default"  # the token's account, named
    assert pod["securityContext"]["runAsNonRoot"] is True
    [container] = pod["containers"]
    assert container["command"] == [
        "modelstage", "node-copy", "--artifact", a.location.path, "--digest", a.digest,
        "--tp", "2", "--agent", "$(MODELSTAGE_NODE_AGENT)",
        "--token-file", "/var/run/secrets/modelstage/token",
    ]  # fmt: skip
    assert {"name": "MODELSTAGE_NODE_AGENT", "value": endpoint} in container["env"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert job["spec"]["activeDeadlineSeconds"] == 900
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "hostPath" not in str(job)
    [source] = volumes["modelstage-node-agent-token"]["projected"]["sources"]
    assert source == {
        "serviceAccountToken": {
            "audience": "modelstage-node-agent", "expirationSeconds": 3600, "path": "token"
        }
    }  # fmt: skip
    assert volumes["modelstage-artifacts"]["persistentVolumeClaim"] == {
        "claimName": "models",
        "readOnly": True,
    }
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["modelstage-artifacts"]["readOnly"] is True
    assert mounts["modelstage-node-agent-token"] == {
        "name": "modelstage-node-agent-token",
        "mountPath": "/var/run/secrets/modelstage",
        "readOnly": True,
    }
    kubernetes_validate.validate(job, "1.28", strict=True)


def nc_node_annotation() -> str:
    from modelstage.operator.node_cache_plan import NODE_ANNOTATION

    return NODE_ANNOTATION


def test_copy_job_of_an_s3_artifact_gets_the_s3_settings_by_reference(
    make_spec: SpecFactory,
) -> None:
    s3 = {
        "pvc": None,
        "s3": {
            "uri": "s3://models/modelstage",
            "endpoint": "http://seaweed.storage:8333",
            "credentialsSecret": "s3-creds",
            "caBundleSecret": "s3-ca",
        },
    }
    spec = make_spec(storage=s3, loadFormat="runai_streamer_sharded", **ON)
    job = plan_copy_job(spec, artifact(spec), "n1", owner=OWNER, endpoint="http://n1:9103")
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://seaweed.storage:8333"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    assert {v["name"] for v in pod["volumes"]} >= {
        "modelstage-s3-ca",
        "modelstage-node-agent-token",
    }
    assert "modelstage-artifacts" not in {v["name"] for v in pod["volumes"]}
    assert container["command"][3].startswith("s3://")


# --- per-node states and the phase ------------------------------------------------------------

DIGEST = "0123456789abcdef0123"
OTHER = "fedcba9876543210fedc"
CONTENT = content_of(DIGEST)


def plan(
    cache: NodeCache | None = None,
    *,
    before: NodeCacheStatus | None = None,
    chosen: tuple[str, ...] = ("a", "b"),
    reports: dict[str, NodeCacheReport] | None = None,
    jobs: dict[str, CopyJob] | None = None,
    starts: tuple[PodStart, ...] = (),
    now: datetime = T0,
    replicas: int = 2,
) -> tuple[NodeCacheStep, list[str]]:
    return plan_node_cache(
        cache or NodeCache(enabled=True),
        ("llm", DIGEST),
        before=before,
        chosen=list(chosen),
        reports=reports or {},
        jobs=jobs or {},
        replicas=replicas,
        pod_starts=starts,
        now=now,
    )


def states(step: NodeCacheStep) -> dict[str, str]:
    return {n.name: n.state for n in step.status.nodes}


def running(node_name: str) -> CopyJob:
    return CopyJob(node_name, copy_job_name(DIGEST, node_name), "Running")


def test_copies_are_asked_for_on_the_chosen_nodes_and_the_roll_waits() -> None:
    step, create = plan()
    assert create == ["a", "b"]
    assert states(step) == {"a": "Pending", "b": "Pending"}
    assert (step.status.phase, step.status.wanted, step.status.ready) == ("Copying", 2, 0)
    assert step.status.since == T0
    assert step.condition[:2] == ("False", "Copying")
    assert "2030" not in step.condition[2] and "2026-03-01T12:30:00Z" in step.condition[2]
    assert not step.roll


def test_running_copies_are_followed_not_created_again() -> None:
    reports = {"a": report("a", partial=(DIGEST, 2_500_000_000)), "b": report("b")}
    step, create = plan(reports=reports, jobs={"a": running("a"), "b": running("b")})
    assert create == []
    assert states(step) == {"a": "Copying", "b": "Copying"}
    assert step.status.nodes[0].message == f"Job {copy_job_name(DIGEST, 'a')} copying"


def test_a_running_copys_status_does_not_change_as_its_bytes_grow() -> None:
    """Each agent report would otherwise rewrite the ModelDeployment's status, whose write
    wakes every agent, whose reports wake the operator again."""
    jobs = {"a": running("a"), "b": running("b")}
    early = {"a": report("a", partial=(DIGEST, 10**9)), "b": report("b")}
    first, _ = plan(reports=early, jobs=jobs)
    later = T0 + timedelta(seconds=20)
    grown = {
        "a": report("a", at=later, partial=(DIGEST, 25 * 10**8)),
        "b": report("b", at=later, partial=(DIGEST, 10**8)),
    }
    step, _ = plan(before=first.status, reports=grown, jobs=jobs, now=later)
    assert step.status == first.status
    assert step.condition == first.condition


def test_an_agents_heartbeat_wakes_only_the_deployments_waiting_for_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not those still staging (no ``status.nodeCache`` yet): their stager Job's events
    bring their reconciliation; a heartbeat would reconcile them once per node and pass."""
    woken: list[str] = []
    patches: list[tuple[str, Any]] = []
    grants = frozenset({("ns", DIGEST)})
    monkeypatch.setattr(handlers, "_reported", {"n1": frozenset({(CONTENT, False, grants)})})
    monkeypatch.setattr(
        handlers, "_reconcile_settled", lambda memo, namespace, name, logger: woken.append(name)
    )
    refs = {
        "ns": [
            handlers.Ref("staging", OTHER, None, None, node_cache=""),
            handlers.Ref("copying", DIGEST, None, None, node_cache="Copying"),
            handlers.Ref("warming", DIGEST, None, None, node_cache="Warming"),
            handlers.Ref(
                "ready", DIGEST, DIGEST, None, node_cache="Ready", cache_nodes=frozenset({"n1"}),
                pins=frozenset({DIGEST, OTHER}),
            ),
            handlers.Ref("off", DIGEST, None, None),
        ]
    }  # fmt: skip
    log = logging.getLogger("test")
    kube = SimpleNamespace(merge_patch=lambda path, body: patches.append((path, body)))
    memo = SimpleNamespace(reconciler=SimpleNamespace(kube=kube))
    spec: dict[str, Any] = {}

    def report_of(warm: bool) -> None:
        grant = {"namespace": "ns", "digest": DIGEST}
        status = {"copies": [{"content": CONTENT, "warm": warm, "grants": [grant]}]}
        handlers.node_cache_event(
            type="MODIFIED", name="n1", spec=spec, status=status, memo=memo, logger=log,
            modeldeployment_refs=refs,
        )  # fmt: skip

    report_of(warm=False)  # a heartbeat: the same copies as before
    assert woken == ["copying", "warming"]
    [(path, patch)] = patches  # the node's spec: what every ModelDeployment pins and warms
    assert path.endswith("/nodecaches/n1")
    assert patch["spec"] == {
        "keep": [{"namespace": "ns", "digest": DIGEST}, {"namespace": "ns", "digest": OTHER}],
        "warm": [],
    }
    spec.update(patch["spec"])
    report_of(warm=True)
    assert woken[2:] == ["copying", "warming", "ready"]  # its copies changed
    assert len(patches) == 1  # the spec was up to date


def test_ready_when_every_chosen_node_reports_the_copy() -> None:
    first, _ = plan(jobs={"a": running("a"), "b": running("b")})
    reports = {"a": report("a", DIGEST), "b": report("b", DIGEST, OTHER)}
    later = T0 + timedelta(minutes=2)
    step, create = plan(before=first.status, reports=reports, now=later)
    assert create == []
    assert states(step) == {"a": "Ready", "b": "Ready"}
    assert (step.status.phase, step.status.ready, step.status.since) == ("Ready", 2, T0)
    assert step.condition[:2] == ("True", "Ready")
    assert step.roll


def test_a_copy_another_namespace_proved_is_not_this_namespaces() -> None:
    """The same content on a node, granted to another tenant only: this namespace's copy
    is still to be made (its Job streams every byte: proof of possession), and its pods are
    given no volume of it."""
    theirs = {n: report(n, DIGEST, namespace="team-b") for n in ("a", "b")}
    step, create = plan(reports=theirs)
    assert create == ["a", "b"] and states(step) == {"a": "Pending", "b": "Pending"}
    assert step.copy is None
    ours = {n: report(n, DIGEST) for n in ("a", "b")}
    step, create = plan(reports=ours)
    assert create == [] and step.copy is not None and step.copy.content == CONTENT


def test_one_node_ready_one_copying_still_waits() -> None:
    reports = {"a": report("a", DIGEST), "b": report("b")}
    step, _ = plan(reports=reports, jobs={"b": running("b")})
    assert (step.status.phase, step.status.ready, step.roll) == ("Copying", 1, False)
    assert "1/2 nodes hold" in step.condition[2]


def test_warm_waits_for_every_node_to_read_its_copy_into_the_page_cache() -> None:
    warm = NodeCache(enabled=True, warm=True)
    held = {"a": report("a", DIGEST, warm=True), "b": report("b", DIGEST)}
    step, _ = plan(warm, reports=held)
    assert (step.status.phase, step.roll) == ("Warming", False)
    assert states(step) == {"a": "Warm", "b": "Ready"}
    assert step.condition[:2] == ("False", "Warming")
    both = {"a": report("a", DIGEST, warm=True), "b": report("b", DIGEST, warm=True)}
    step, _ = plan(warm, before=step.status, reports=both)
    assert (step.status.phase, step.roll, step.condition[:2]) == ("Ready", True, ("True", "Ready"))


def test_the_deadline_rolls_anyway_and_says_so() -> None:
    first, _ = plan(jobs={"a": running("a")})
    reports = {"a": report("a", DIGEST), "b": report("b")}
    late = T0 + timedelta(seconds=1800)
    step, _ = plan(before=first.status, reports=reports, jobs={"b": running("b")}, now=late)
    assert (step.status.phase, step.roll) == ("DeadlinePassed", True)
    assert step.condition[:2] == ("False", "DeadlinePassed")
    assert "1/2 nodes hold" in step.condition[2] and "rolled anyway" in step.condition[2]
    # Just before the deadline it still waits.
    early = late - timedelta(seconds=1)
    step, _ = plan(before=first.status, reports=reports, jobs={"b": running("b")}, now=early)
    assert (step.status.phase, step.roll) == ("Copying", False)


def test_once_the_roll_went_ahead_the_phase_stays_open() -> None:
    passed = NodeCacheStatus(digest=DIGEST, phase="DeadlinePassed", since=T0, wanted=2)
    reports = {"a": report("a", DIGEST), "b": report("b")}
    step, _ = plan(before=passed, reports=reports, jobs={"b": running("b")})
    assert (step.status.phase, step.roll) == ("DeadlinePassed", True)
    reports["b"] = report("b", DIGEST)
    step, _ = plan(before=step.status, reports=reports)
    assert (step.status.phase, step.roll, step.condition[0]) == ("Ready", True, "True")


def test_a_failed_copy_is_reported_with_its_reason_and_the_others_are_waited_for() -> None:
    failed = CopyJob(
        "b",
        copy_job_name(DIGEST, "b"),
        "Failed",
        "copying rank 0\nerror: model-rank-0.safetensors: chunk 3 (bytes 3-4): expected aa, got bb",
    )
    reports = {"a": report("a", DIGEST), "b": report("b")}
    step, create = plan(reports=reports, jobs={"b": failed})
    assert create == []
    assert states(step) == {"a": "Ready", "b": "Failed"}
    assert "chunk 3" in step.status.nodes[1].message
    assert "copying rank 0" not in step.status.nodes[1].message
    assert step.condition[:2] == ("False", "CopyFailed")
    assert "b" in step.condition[2] and not step.roll


def test_a_node_that_loses_its_copy_shows_in_the_status() -> None:
    done = CopyJob("b", copy_job_name(DIGEST, "b"), "Succeeded")
    held = {"a": report("a", DIGEST), "b": report("b", DIGEST)}
    ready, _ = plan(reports=held, jobs={"b": done})
    assert ready.status.phase == "Ready"
    lost = {"a": report("a", DIGEST), "b": report("b")}
    step, create = plan(before=ready.status, reports=lost, jobs={"b": done})
    assert create == [] and step.replace == (done.name,)  # no other node: copied again
    assert states(step) == {"a": "Ready", "b": "Failed"}
    assert "no longer holds" in step.status.nodes[1].message
    assert (step.status.phase, step.status.ready) == ("Ready", 1)
    assert step.condition[:2] == ("False", "CopyLost")
    again, _ = plan(before=step.status, reports=lost, jobs={"b": done})
    assert states(again)["b"] == "Failed"  # stays lost, not "waiting for the report"


def test_a_lost_copy_is_copied_again_by_exactly_one_new_job() -> None:
    """Pass by pass, as the shell runs them: the lost node's Job is deleted, the next pass
    (no Job there) creates one, and that Job's success while the agent's report still lags
    is a copy to wait for, not the old copy lost once more."""
    done = CopyJob("b", copy_job_name(DIGEST, "b"), "Succeeded")
    held = {"a": report("a", DIGEST), "b": report("b", DIGEST)}
    lost = {"a": report("a", DIGEST), "b": report("b")}
    ready, _ = plan(reports=held, jobs={"b": done})
    dropped, create = plan(before=ready.status, reports=lost, jobs={"b": done})
    assert (create, dropped.replace) == ([], (done.name,))
    deleted, create = plan(before=dropped.status, reports=lost, jobs={})
    assert (create, deleted.replace, states(deleted)["b"]) == (["b"], (), "Pending")
    copying, create = plan(before=deleted.status, reports=lost, jobs={"b": running("b")})
    assert (create, copying.replace, states(copying)["b"]) == ([], (), "Copying")
    for before in (deleted.status, copying.status):  # the new Job done, the report not yet
        waiting, create = plan(before=before, reports=lost, jobs={"b": done})
        assert (create, waiting.replace, states(waiting)["b"]) == ([], (), "Copying")
    back, create = plan(before=waiting.status, reports=held, jobs={"b": done})
    assert (create, back.replace, states(back)["b"]) == ([], (), "Ready")


def choose_and_plan(
    eligible: list[str],
    *,
    before: NodeCacheStatus | None,
    reports: dict[str, NodeCacheReport],
    jobs: dict[str, CopyJob],
    replicas: int,
) -> tuple[NodeCacheStep, list[str]]:
    """One reconciliation's choice of nodes, then its plan (as ``reconcile`` does)."""
    chosen = choose_nodes(
        eligible,
        ("llm", DIGEST),
        mode="Replicas",
        replicas=replicas,
        reports=reports,
        jobs=jobs,
        before=before,
    )
    return plan(before=before, chosen=tuple(chosen), reports=reports, jobs=jobs, replicas=replicas)


def test_a_node_whose_copy_failed_gives_way_to_another_eligible_node() -> None:
    failed = CopyJob("a", copy_job_name(DIGEST, "a"), "Failed", "error: no space left on device")
    reports = {n: report(n) for n in ("a", "b", "c")}
    kept = {"b": running("b")}
    step, create = choose_and_plan(
        ["a", "b", "c"], before=None, reports=reports, jobs={"a": failed, **kept}, replicas=2
    )
    assert create == ["c"]
    assert states(step) == {"a": "Failed", "b": "Copying", "c": "Pending"}
    assert (step.status.wanted, step.condition[1]) == (2, "Copying")  # not CopyFailed
    # With no other node left, the failed one is still chosen (and says why it waits).
    step, create = choose_and_plan(
        ["a", "b"], before=None, reports=reports, jobs={"a": failed, **kept}, replicas=2
    )
    assert (create, step.status.wanted, step.condition[1]) == ([], 2, "CopyFailed")


def test_a_node_that_lost_its_copy_gives_way_and_stays_known_as_lost() -> None:
    done = CopyJob("b", copy_job_name(DIGEST, "b"), "Succeeded")
    eligible = ["b", "c"]
    held = {"b": report("b", DIGEST), "c": report("c")}
    ready, create = choose_and_plan(
        eligible, before=None, reports=held, jobs={"b": done}, replicas=1
    )
    assert (states(ready), create) == ({"b": "Ready"}, [])
    lost = {"b": report("b"), "c": report("c")}
    step, create = choose_and_plan(
        eligible, before=ready.status, reports=lost, jobs={"b": done}, replicas=1
    )
    assert create == ["c"] and step.replace == ()  # c takes its place: b's Job stays
    assert states(step) == {"b": "Failed", "c": "Pending"}
    assert "no longer holds" in step.status.nodes[0].message
    # The next reconciliation: b's Job still says Succeeded; b must not look like a copy
    # that just finished (and win the choice back from c).
    jobs = {"b": done, "c": running("c")}
    again, create = choose_and_plan(
        eligible, before=step.status, reports=lost, jobs=jobs, replicas=1
    )
    assert create == []
    assert states(again) == {"b": "Failed", "c": "Copying"}
    assert (again.status.wanted, again.status.ready) == (1, 0)


def test_a_workload_without_replicas_does_not_wait_for_copies() -> None:
    step, create = plan(chosen=(), replicas=0)
    assert (create, step.roll, step.status.phase) == ([], True, "Ready")
    assert step.condition[:2] == ("True", "Ready")
    assert "no replicas" in step.condition[2]
    # Scaled up again later: copies are asked for, the open phase stays open.
    step, create = plan(before=step.status, chosen=("a",), replicas=1)
    assert (create, step.roll, step.status.phase) == (["a"], True, "Ready")
    # With replicas but no eligible node, the roll still waits.
    waiting, _ = plan(chosen=(), replicas=1)
    assert (waiting.roll, waiting.condition[1]) == (False, "NoEligibleNodes")


def test_a_copy_job_done_before_the_agent_reports_it_is_still_copying() -> None:
    done = CopyJob("a", copy_job_name(DIGEST, "a"), "Succeeded")
    first, _ = plan(chosen=("a",))
    step, _ = plan(before=first.status, chosen=("a",), reports={"a": report("a")}, jobs={"a": done})
    assert states(step) == {"a": "Copying"}


def test_no_eligible_node_waits_until_the_deadline() -> None:
    step, create = plan(chosen=())
    assert create == [] and step.condition[:2] == ("False", "NoEligibleNodes")
    assert not step.roll
    late, _ = plan(before=step.status, chosen=(), now=T0 + timedelta(hours=1))
    assert late.roll and late.status.phase == "DeadlinePassed"


def test_a_new_digest_starts_its_own_deadline() -> None:
    old = NodeCacheStatus(digest=OTHER, phase="Ready", since=T0 - timedelta(days=1))
    step, _ = plan(before=old)
    assert (step.status.since, step.status.phase) == (T0, "Copying")


def test_hits_and_misses_per_node_including_nodes_without_a_copy() -> None:
    starts = (PodStart("a", "hit"), PodStart("a", "hit"), PodStart("z", "miss"))
    step, _ = plan(reports={"a": report("a", DIGEST), "b": report("b", DIGEST)}, starts=starts)
    by_name = {n.name: n for n in step.status.nodes}
    assert (by_name["a"].hits, by_name["a"].misses) == (2, 0)
    assert (by_name["z"].state, by_name["z"].hits, by_name["z"].misses) == ("Pending", 0, 1)
    assert step.status.wanted == 2  # a node without a copy is shown, not wanted


def test_pod_start_reads_prepares_summary() -> None:
    def pod(message: str, node_name: str | None = "a") -> dict[str, Any]:
        terminated = {"exitCode": 0, "message": message}
        return {
            "spec": {"nodeName": node_name} if node_name else {},
            "status": {
                "initContainerStatuses": [
                    {"name": "modelstage-prepare", "state": {"terminated": terminated}}
                ]
            },
        }

    hit = '{"digest": "d", "nodeCache": {"result": "hit", "path": "/x"}}'
    miss = 'checking\n{"digest": "d", "nodeCache": {"result": "miss", "reason": "none"}}'
    assert pod_start(pod(hit), "modelstage-prepare") == PodStart("a", "hit")
    assert pod_start(pod(miss), "modelstage-prepare") == PodStart("a", "miss")
    assert pod_start(pod('{"digest": "d"}'), "modelstage-prepare") is None
    assert pod_start(pod(hit, None), "modelstage-prepare") is None
    assert pod_start(pod(hit), "other") is None


# --- the state machine ------------------------------------------------------------------------


def staged_status(a: Artifact) -> ModelDeploymentStatus:
    current = ArtifactStatus(
        digest=a.digest, uri=a.location.uri, format="sharded_state", tensor_parallel_size=2
    )
    return ModelDeploymentStatus(phase="Staged", artifact=current)


def step_of(a: Artifact, *, roll: bool, create: tuple[dict[str, Any], ...] = ()) -> NodeCacheStep:
    status = NodeCacheStatus(
        digest=a.digest, phase="Ready" if roll else "Copying", since=T0, wanted=1
    )
    reason = ("True", "Ready", "1/1") if roll else ("False", "Copying", "0/1")
    copied = held(a.digest) if roll else None
    return NodeCacheStep(status=status, condition=reason, roll=roll, create=create, copy=copied)


def observed(step: NodeCacheStep | None, *, job: JobObservation | None = None) -> Observed:
    return Observed(
        generation=1,
        now=T0,
        job=job,
        workload=WorkloadObservation(digest=None),
        node_cache_enabled=True,
        node_cache=step,
    )


def test_a_finished_staging_records_the_artifact_and_copies_before_rolling(
    spec: ModelDeploymentSpec,
) -> None:
    a = artifact(spec)
    job = JobObservation("Succeeded", f'{{"digest": "{a.digest}", "bytes": 10}}', T0)
    create = ({"metadata": {"name": "copy"}},)
    d = decide(a, ModelDeploymentStatus(), observed(step_of(a, roll=False, create=create), job=job))
    assert d.action is Action.CREATE_COPY_JOBS
    assert d.status.phase == "Staged"
    assert d.status.artifact is not None and d.status.artifact.digest == a.digest
    assert d.status.node_cache is not None and d.status.node_cache.phase == "Copying"
    cached = d.status.condition("NodeCached")
    assert cached is not None and (cached.status, cached.reason) == ("False", "Copying")
    assert d.status.reason == "Copying"
    # Without the step (not observed yet), it waits too: never a roll before the copies.
    d = decide(a, ModelDeploymentStatus(), observed(None, job=job))
    assert (d.action, d.status.phase) == (Action.WAIT, "Staged")


def test_no_copy_job_for_a_workload_that_has_not_opted_in(spec: ModelDeploymentSpec) -> None:
    a = artifact(spec)
    create = ({"metadata": {"name": "copy"}},)
    step = step_of(a, roll=False, create=create)
    not_opted_in = Finding("TargetNotOptedIn", "add the annotation", "rollout")
    refused = replace(observed(step), findings=(not_opted_in,))
    assert decide(a, staged_status(a), refused).action is Action.WAIT
    off = replace(observed(step), node_cache_enabled=False)
    assert decide(a, staged_status(a), off).action is not Action.CREATE_COPY_JOBS
    assert decide(a, staged_status(a), observed(step)).action is Action.CREATE_COPY_JOBS


def test_the_roll_waits_for_the_copies_then_goes(spec: ModelDeploymentSpec) -> None:
    a = artifact(spec)
    waiting = decide(a, staged_status(a), observed(step_of(a, roll=False)))
    assert (waiting.action, waiting.status.phase) == (Action.WAIT, "Staged")
    go = decide(a, waiting.status, observed(step_of(a, roll=True)))
    assert (go.action, go.status.phase) == (Action.ROLL_OUT, "RollingOut")
    assert go.artifact is not None and go.artifact.digest == a.digest
    cached = go.status.condition("NodeCached")
    assert cached is not None and (cached.status, cached.reason) == ("True", "Ready")


def test_node_caching_off_leaves_no_trace_in_the_status(spec: ModelDeploymentSpec) -> None:
    a = artifact(spec)
    waiting = decide(a, staged_status(a), observed(step_of(a, roll=False)))
    assert waiting.status.node_cache is not None
    off = Observed(generation=1, now=T0, workload=WorkloadObservation(digest=None))
    d = decide(a, waiting.status, off)
    assert d.action is Action.ROLL_OUT
    assert d.status.node_cache is None and d.status.condition("NodeCached") is None
    assert "nodeCache" not in d.status.wire()


def test_headline_shows_the_copy_wait_and_then_ready() -> None:
    from modelstage.operator.conditions import condition

    staged = condition("Staged", "True", "Staged", "", now=T0)
    ready = condition("Ready", "True", "Serving", "", now=T0)
    copying = condition("NodeCached", "False", "Copying", "", now=T0)
    passed = condition("NodeCached", "False", "DeadlinePassed", "", now=T0)
    assert headline([staged, ready, copying]) == "Copying"
    assert headline([staged, ready, passed]) == "Serving"


def test_node_caching_needs_the_plugin(make_spec: SpecFactory) -> None:
    findings = validate_spec(make_spec(serving={"plugin": False}, **ON))
    [finding] = [f for f in findings if f.reason == "NodeCacheNeedsPlugin"]
    assert finding.blocks == "staging"
    assert not [f for f in validate_spec(make_spec(**ON)) if f.reason == "NodeCacheNeedsPlugin"]


def test_the_root_setting_is_an_absolute_normalized_path() -> None:
    assert OperatorConfig.from_env({}).node_cache_root == nc.DEFAULT_ROOT
    env = {"MODELSTAGE_NODE_CACHE_ROOT": "/mnt/nvme/modelstage"}
    assert OperatorConfig.from_env(env).node_cache_root == "/mnt/nvme/modelstage"
    for bad in ("relative/path", "/", "/a/../etc"):
        with pytest.raises(ValueError, match="MODELSTAGE_NODE_CACHE_ROOT"):
            OperatorConfig.from_env({"MODELSTAGE_NODE_CACHE_ROOT": bad})


# --- the roll patch ---------------------------------------------------------------------------


CLAIM = "modelstage-node-cache-" + CONTENT[:20]


def roll(spec: ModelDeploymentSpec, workload: dict[str, Any], claim: str | None = CLAIM) -> Any:
    patch = plan_rollout(spec, artifact(spec), workload, node_cache_claim=claim).merge_patch
    return apply_merge_patch(workload, patch)


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = workload["spec"]["template"]["spec"]
    return result


def test_the_roll_mounts_its_copys_claim_read_only_with_the_reader_group(
    spec: ModelDeploymentSpec, deployment: dict[str, Any]
) -> None:
    pod_of(deployment)["securityContext"] = {"supplementalGroups": [1000]}
    rolled = roll(spec, deployment)
    pod = pod_of(rolled)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["modelstage-node-cache"] == {
        "name": "modelstage-node-cache",
        "persistentVolumeClaim": {"claimName": CLAIM, "readOnly": True},
    }
    assert "hostPath" not in str(rolled)
    assert pod["securityContext"]["supplementalGroups"] == [1000, nc.CACHE_GID]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    prepare = next(c for c in pod["initContainers"] if c["name"] == "modelstage-prepare")
    for container in (vllm, prepare):
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "modelstage-node-cache"]
        assert mount == {
            "name": "modelstage-node-cache",
            "mountPath": nc.POD_MOUNT,
            "readOnly": True,
        }
    assert {"name": nc.ENV_NODE_CACHE, "value": nc.POD_MOUNT} in vllm["env"]
    assert prepare["command"][-2:] == ["--node-cache", nc.POD_MOUNT]
    assert "affinity" not in pod  # the PV's node affinity places the pods
    replanned = plan_rollout(spec, artifact(spec), rolled, node_cache_claim=CLAIM)
    assert replanned.merge_patch == {}
    kubernetes_validate.validate(rolled, "1.28", strict=True)


USER_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [expr("gpu", "Exists")]}]
        },
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "preference": {"matchExpressions": [expr("zone", "In", "a")]}},
            {"weight": 5, "preference": {"matchExpressions": [expr("disk", "In", "nvme")]}},
        ],
    },
    "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
}


def test_an_older_releases_node_preference_goes_and_the_users_terms_stay(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    ours = {
        "weight": 100,
        "preference": {
            "matchExpressions": [{"key": nc.LABEL_PREFIX + DIGEST, "operator": "Exists"}]
        },
    }
    user = copy.deepcopy(USER_AFFINITY)
    user["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"].insert(1, ours)
    pod_of(deployment)["affinity"] = user
    affinity = pod_of(roll(make_spec(**ON), deployment))["affinity"]
    assert affinity == USER_AFFINITY


def test_turning_node_caching_off_removes_what_it_added(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    pristine = roll(make_spec(), copy.deepcopy(deployment))
    rolled = roll(make_spec(**ON), deployment)
    off = roll(make_spec(), rolled)
    assert (
        off["spec"]["template"]["spec"]["volumes"]
        == pristine["spec"]["template"]["spec"]["volumes"]
    )
    for key in ("containers", "initContainers"):
        assert off["spec"]["template"]["spec"][key] == pristine["spec"]["template"]["spec"][key]
    assert "affinity" not in pod_of(off)


def test_off_by_default_without_the_plugin_or_a_copy_the_patch_has_no_node_cache_parts(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    cases = [
        (make_spec(), CLAIM),
        (make_spec(serving={"plugin": False}, **ON), CLAIM),
        (make_spec(**ON), None),  # the deadline passed without a copy
    ]
    for spec, claim in cases:
        rolled = pod_of(roll(spec, copy.deepcopy(deployment), claim))
        text = str(rolled)
        assert "node-cache" not in text and "affinity" not in rolled
        assert nc.ENV_NODE_CACHE not in text


# --- the shell's reading ----------------------------------------------------------------------


class ForbiddenKube:
    """The API as an operator without the node cache's read rights sees it."""

    def list(self, path: str, label_selector: Any = None) -> list[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        if path.endswith(("/nodes", "/nodecaches")):
            raise ApiException(status=403, reason="nodes is forbidden")
        return []


def test_without_the_rights_to_read_nodes_the_status_says_so_and_the_deadline_holds(
    spec: ModelDeploymentSpec, deployment: dict[str, Any]
) -> None:
    from modelstage.operator.observe import World
    from modelstage.operator.reconcile import Reconciler

    a = artifact(spec)
    reconciler = Reconciler(ForbiddenKube(), stager_image="x", post_event=lambda *_: None)  # type: ignore[arg-type]
    world = World(
        body={}, owner=OWNER, status=staged_status(a), now=T0, desired=a, workload=deployment
    )
    reconciler.observer.observe_node_cache(world, spec)
    [finding] = world.findings
    assert finding.reason == "NodeCacheForbidden" and "get, list and watch" in finding.message
    assert world.node_cache is not None
    assert world.node_cache.condition[1] == "NoEligibleNodes" and not world.node_cache.roll
    assert world.node_cache.create == ()


def test_turning_node_caching_on_or_off_repatches_a_workload_already_on_the_artifact(
    spec: ModelDeploymentSpec,
) -> None:
    a = artifact(spec)
    current = staged_status(a).model_copy(update={"phase": "Ready"})
    plain = WorkloadObservation(digest=a.digest)
    cached = WorkloadObservation(digest=a.digest, node_cache=True)
    copying = Observed(
        generation=2, now=T0, workload=plain, node_cache_enabled=True,
        node_cache=step_of(a, roll=False),
    )  # fmt: skip
    d = decide(a, current, copying)
    assert (d.action, d.status.phase) == (Action.WAIT, "Ready")  # serves on while copying
    ready = Observed(
        generation=2, now=T0, workload=plain, node_cache_enabled=True,
        node_cache=step_of(a, roll=True),
    )  # fmt: skip
    d = decide(a, current, ready)
    assert d.action is Action.ROLL_OUT and d.artifact == current.artifact
    assert decide(a, current, replace_workload(ready, cached)).action is Action.WAIT
    off = Observed(generation=3, now=T0, workload=cached)
    assert decide(a, current, off).action is Action.ROLL_OUT
    assert decide(a, current, replace_workload(off, plain)).action is Action.WAIT


def replace_workload(observed: Observed, workload: WorkloadObservation) -> Observed:
    from dataclasses import replace

    return replace(observed, workload=workload)


def test_a_digest_that_was_rolled_back_gets_no_copies(
    spec: ModelDeploymentSpec, deployment: dict[str, Any]
) -> None:
    from modelstage.operator.observe import World
    from modelstage.operator.reconcile import Reconciler

    a = artifact(spec)
    rolled_back = ModelDeploymentStatus(phase="Failed", failed_digest=a.digest)
    done = JobObservation("Succeeded", f'{{"digest": "{a.digest}"}}', T0)
    reconciler = Reconciler(ForbiddenKube(), stager_image="x", post_event=lambda *_: None)  # type: ignore[arg-type]
    world = World(
        body={}, owner=OWNER, status=rolled_back, now=T0, desired=a, workload=deployment, job=done
    )
    reconciler.observer.observe_node_cache(world, spec)
    assert world.node_cache is None and not world.findings
    world.status = ModelDeploymentStatus()  # the same Job, not rolled back: it is copied
    reconciler.observer.observe_node_cache(world, spec)
    assert world.node_cache is not None


class RecordingKube:
    """Creates succeed and are recorded."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.created.append(body["metadata"]["name"])
        return body


def test_copy_jobs_take_the_namespaces_stager_slots(
    spec: ModelDeploymentSpec, deployment: dict[str, Any]
) -> None:
    """A copy Job holds a stager slot like a stage Job: with one slot per namespace, the
    second waits (created on a later reconciliation, once the first one's Job ended)."""
    from modelstage.operator.observe import World
    from modelstage.operator.reconcile import Reconciler
    from modelstage.operator.slots import StagerSlots

    a = artifact(spec)
    kube = RecordingKube()
    slots = StagerSlots(0, per_namespace=1)
    reconciler = Reconciler(kube, stager_image="x", post_event=lambda *_: None, slots=slots)  # type: ignore[arg-type]
    world = World(body={}, owner=OWNER, status=staged_status(a), now=T0, desired=a)
    jobs = [
        plan_copy_job(spec, a, node, owner=OWNER, endpoint="http://10.0.0.1:9103")
        for node in ("a", "b")
    ]
    reconciler.actor.create_copy_jobs(world, jobs, logging.getLogger("test"))
    assert kube.created == [jobs[0]["metadata"]["name"]]
    assert slots.finished(("llm", jobs[0]["metadata"]["name"]))  # its Job ended
    reconciler.actor.create_copy_jobs(world, jobs[1:], logging.getLogger("test"))
    assert kube.created == [j["metadata"]["name"] for j in jobs]
