"""Resolving the source before the digest: when a resolution is due, the resolve Job's shape,
what ``decide`` makes of each step, and the stage Job pinned to what was resolved."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from modelstage.api.modeldeployment import (
    ArtifactStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
)
from modelstage.api.objects import Owner
from modelstage.operator.artifact import artifact_at, artifact_for, spec_digest
from modelstage.operator.job_plan import (
    RESOLVE_CONTAINER,
    plan_resolve_job,
    plan_stage_job,
    stage_job_name,
)
from modelstage.operator.observations import (
    JobObservation,
    Observed,
    WorkloadObservation,
    progress_line,
    staging_progress,
)
from modelstage.operator.resolve_plan import (
    RESOLVE_TTL_SECONDS,
    SourceStep,
    parse_resolution,
    pinned_identity,
    plan_source,
    recorded_identity,
    resolve_job_name,
    source_key,
)
from modelstage.operator.state import (
    Action,
    decide,
    headline,
)
from modelstage.stager.cli import build_parser

SpecFactory = Callable[..., ModelDeploymentSpec]
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OWNER = Owner(name="llama", namespace="llm", uid="5f1c0000-0000-4000-8000-000000000001")
COMMIT_A, COMMIT_B = "a1" * 20, "b2" * 20


def resolution(commit: str, **extra: Any) -> str:
    """The resolve Job's termination message (``modelstage resolve``'s line)."""
    return json.dumps({"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct", "revision": "main",
                       "identity": f"commit:{commit}", "commit": commit, "kind": "hf", **extra})  # fmt: skip


def step(
    spec: ModelDeploymentSpec,
    status: ModelDeploymentStatus | None = None,
    *,
    job: JobObservation | None = None,
    now: datetime = T0,
    interval: float = 0,
) -> SourceStep:
    recorded = (status or ModelDeploymentStatus()).source
    return plan_source(spec, recorded, owner="llama", now=now, interval=interval, job=job)


def resolved_status(
    spec: ModelDeploymentSpec, commit: str, at: datetime = T0
) -> ModelDeploymentStatus:
    done = step(spec, job=JobObservation("Succeeded", resolution(commit)), now=at)
    assert done.state == "resolved" and done.source is not None
    return ModelDeploymentStatus(source=done.source)


def test_a_branch_is_resolved_by_a_job_before_any_digest_exists(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": "main"})
    first = step(spec)
    assert (first.state, first.source) == ("create", None)
    assert first.job_name == resolve_job_name(spec, None, "llama")
    assert first.job_name.startswith("modelstage-resolve-") and len(first.job_name) <= 63
    assert step(spec, job=JobObservation("Running")).state == "resolving"
    # Done, but its pod's termination message not seen yet: still resolving, nothing guessed.
    assert step(spec, job=JobObservation("Succeeded", "")).state == "resolving"
    done = step(spec, job=JobObservation("Succeeded", f"log line\n{resolution(COMMIT_A)}\n"))
    assert done.state == "resolved" and done.source is not None
    assert (done.source.identity, done.source.commit) == (f"commit:{COMMIT_A}", COMMIT_A)
    assert (done.source.resolved_at, done.source.job) == (T0, first.job_name)
    assert done.source.key == source_key(spec)


def test_a_recorded_identity_holds_until_the_interval_passes(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": "main"})
    status = resolved_status(spec, COMMIT_A)
    later = T0 + timedelta(seconds=3599)
    assert step(spec, status, now=later, interval=3600).state == "resolved"
    assert step(spec, status, now=later + timedelta(days=30), interval=0).state == "resolved"
    due = step(spec, status, now=T0 + timedelta(seconds=3600), interval=3600)
    assert due.state == "create"
    assert due.source == status.source  # the old identity serves while it runs
    assert due.job_name != resolve_job_name(spec, None, "llama")  # a new round, a new Job


def test_a_spec_change_of_the_source_fields_resolves_again(make_spec: SpecFactory) -> None:
    status = resolved_status(make_spec(model={"revision": "main"}), COMMIT_A)
    moved = make_spec(model={"revision": "v2"})
    assert step(moved, status).state == "create" and step(moved, status).source is None
    assert recorded_identity(moved, status.source) is None
    same_source = make_spec(model={"revision": "main"}, parallelism={"tensor": 4})
    assert step(same_source, status).state == "resolved"  # TP is not a source field


def test_a_pinned_commit_needs_no_job(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": COMMIT_A})
    assert pinned_identity(spec) == f"commit:{COMMIT_A}"
    pinned = step(spec, now=T0, interval=60)
    assert pinned.state == "resolved" and pinned.source is not None
    assert pinned.source.identity == f"commit:{COMMIT_A}" and pinned.source.job is None
    again = step(spec, ModelDeploymentStatus(source=pinned.source), now=T0 + timedelta(days=1),
                 interval=60)  # fmt: skip
    assert again.source == pinned.source  # never due, resolvedAt unchanged: no status churn
    assert pinned_identity(make_spec(model={"revision": "main"})) is None
    assert pinned_identity(make_spec(model={"revision": COMMIT_A.upper()})) is None


def test_a_failed_resolve_job_says_why_and_how_it_is_retried(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": "main"})
    failed = step(spec, job=JobObservation("Failed", "error: hf://x: repository not found"))
    assert failed.state == "failed" and failed.source is None
    assert "error: hf://x: repository not found" in failed.message
    assert f"after {RESOLVE_TTL_SECONDS} s or when deleted" in failed.message


@pytest.mark.parametrize(
    "message",
    ["", "not json", '{"identity": "main"}', '{"uri": "x"}', '["commit:' + "a" * 40 + '"]'],
)
def test_only_a_resolved_identity_is_taken_from_a_termination_message(message: str) -> None:
    assert parse_resolution(message) is None


# --- decide with the resolution step ---------------------------------------------------------


def observed(
    workload: WorkloadObservation | None = None, job: JobObservation | None = None
) -> Observed:
    return Observed(generation=1, now=T0, job=job, workload=workload)


def test_decide_creates_the_resolve_job_first_and_stays_pending(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": "main"})
    d = decide(None, ModelDeploymentStatus(), observed(), step(spec))
    assert (d.action, d.status.phase) == (Action.CREATE_RESOLVE_JOB, "Pending")
    staged = d.status.condition("Staged")
    assert staged is not None and (staged.status, staged.reason) == ("False", "Resolving")
    assert "resolving the source identity of hf://meta-llama/Meta-Llama-3-8B-Instruct@main" in (
        staged.message
    )
    assert d.status.reason == "Resolving" and d.status.desired_digest is None
    running = decide(
        None, ModelDeploymentStatus(), observed(), step(spec, job=JobObservation("Running"))
    )
    assert (running.action, running.status.reason) == (Action.WAIT, "Resolving")


def test_decide_fails_on_a_first_resolution_that_failed(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": "main"})
    s = step(spec, job=JobObservation("Failed", "error: cannot reach the Hub"))
    d = decide(None, ModelDeploymentStatus(), observed(), s)
    assert (d.action, d.status.phase, d.status.reason) == (Action.WAIT, "Failed", "ResolveFailed")
    degraded = d.status.condition("Degraded")
    assert degraded is not None and degraded.status == "True"
    assert "cannot reach the Hub" in degraded.message


def test_a_source_that_changed_stages_anew_while_the_old_artifact_serves(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec(model={"revision": "main"})
    status = resolved_status(spec, COMMIT_A)
    old = artifact_for(
        spec, namespace="llm", deployment_name="llama", identity=f"commit:{COMMIT_A}"
    )
    serving = ArtifactStatus(digest=old.digest, uri=old.location.uri, format="sharded_state",
                             tensor_parallel_size=2, source=f"commit:{COMMIT_A}")  # fmt: skip
    ready = status.model_copy(update={"artifact": serving, "phase": "Ready"})
    workload = WorkloadObservation(digest=old.digest)

    later = T0 + timedelta(hours=1)
    due = plan_source(spec, ready.source, owner="llama", now=later, interval=3600, job=None)
    d = decide(old, ready, Observed(generation=1, now=later, workload=workload), due)
    assert (d.action, d.status.phase) == (Action.CREATE_RESOLVE_JOB, "Ready")
    assert d.status.source == ready.source

    moved = plan_source(spec, ready.source, owner="llama", now=later, interval=3600,
                        job=JobObservation("Succeeded", resolution(COMMIT_B)))  # fmt: skip
    assert moved.source is not None and moved.source.identity == f"commit:{COMMIT_B}"
    new = artifact_for(
        spec, namespace="llm", deployment_name="llama", identity=moved.source.identity
    )
    assert new.digest != old.digest
    d = decide(new, ready, Observed(generation=1, now=later, workload=workload), moved)
    assert (d.action, d.status.phase) == (Action.CREATE_JOB, "Staging")
    assert d.status.desired_digest == new.digest and d.status.source == moved.source
    assert d.status.artifact == serving  # stage before roll: the old one serves meanwhile

    unchanged = plan_source(spec, ready.source, owner="llama", now=later, interval=3600,
                            job=JobObservation("Succeeded", resolution(COMMIT_A)))  # fmt: skip
    d = decide(old, ready, Observed(generation=1, now=later, workload=workload), unchanged)
    assert d.action is Action.WAIT and d.status.desired_digest == old.digest
    assert d.status.source is not None and d.status.source.resolved_at == later


def test_a_failed_periodic_resolution_keeps_serving_and_says_so(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": "main"})
    status = resolved_status(spec, COMMIT_A)
    old = artifact_for(
        spec, namespace="llm", deployment_name="llama", identity=f"commit:{COMMIT_A}"
    )
    serving = ArtifactStatus(digest=old.digest, uri=old.location.uri, format="sharded_state",
                             tensor_parallel_size=2)  # fmt: skip
    ready = status.model_copy(update={"artifact": serving, "phase": "Ready"})
    later = T0 + timedelta(hours=2)
    failed = plan_source(spec, ready.source, owner="llama", now=later, interval=3600,
                         job=JobObservation("Failed", "error: HTTP 503"))  # fmt: skip
    d = decide(old, ready, Observed(generation=1, now=later,
                                    workload=WorkloadObservation(digest=old.digest)), failed)  # fmt: skip
    assert (d.action, d.status.phase, d.status.reason) == (Action.WAIT, "Ready", "ResolveFailed")
    assert d.status.source == ready.source


# --- the Jobs ---------------------------------------------------------------------------------


def test_the_resolve_job_runs_modelstage_resolve_with_the_stage_jobs_pod_settings(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec(model={"revision": "main"}, storage={"pvc": None, "s3": {
        "uri": "s3://bkt/p", "credentialsSecret": "s3-creds"}}, loadFormat="tensorizer")  # fmt: skip
    job = plan_resolve_job(spec, owner=OWNER, name="modelstage-resolve-x")
    stage = plan_stage_job(spec, owner=OWNER, artifact=artifact_at(spec, namespace=OWNER.namespace, deployment_name=OWNER.name, digest="d" * 20))
    pod, stage_pod = job["spec"]["template"]["spec"], stage["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == RESOLVE_CONTAINER
    assert container["command"] == ["modelstage", "resolve", spec.model.uri, "--revision=main"]
    args = build_parser().parse_args(container["command"][1:])
    assert (args.source, args.revision) == (spec.model.uri, "main")
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    (stage_container,) = stage_pod["containers"]
    for key in ("securityContext", "image"):
        assert container[key] == stage_container[key]
    for key in ("securityContext", "automountServiceAccountToken", "restartPolicy"):
        assert pod[key] == stage_pod[key]
    env = {e["name"] for e in container["env"]}
    assert "HF_TOKEN" in env and not env & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert not any(v["name"] == "modelstage-artifacts" for v in pod["volumes"])
    assert job["metadata"]["ownerReferences"] == [OWNER.reference()]
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "resolve"
    assert job["spec"]["ttlSecondsAfterFinished"] == RESOLVE_TTL_SECONDS


def test_a_pvc_source_is_resolved_where_the_stager_reads_it(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"uri": "pvc://checkpoints/llama", "credentialsSecret": None})
    job = plan_resolve_job(spec, owner=OWNER, name="modelstage-resolve-x")
    stage = plan_stage_job(spec, owner=OWNER, artifact=artifact_at(spec, namespace=OWNER.namespace, deployment_name=OWNER.name, digest="d" * 20))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (stage_container,) = stage["spec"]["template"]["spec"]["containers"]
    source_path = stage_container["command"][2]
    assert container["command"][2:] == [source_path, "--source-uri=pvc://checkpoints/llama"]
    mounts = [m for m in container["volumeMounts"] if m["name"] == "modelstage-source"]
    assert mounts and mounts[0]["readOnly"] is True
    assert container["env"] == [e for e in container["env"] if "valueFrom" not in e]


def test_the_stage_job_is_pinned_to_the_resolved_commit_and_identity(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec(model={"revision": "main"})
    source = resolved_status(spec, COMMIT_A).source
    assert source is not None
    digest = spec_digest(spec, source.identity)
    job = plan_stage_job(spec, owner=OWNER, artifact=artifact_at(spec, namespace=OWNER.namespace, deployment_name=OWNER.name, digest=digest), source=source)
    assert job["metadata"]["name"] == stage_job_name(digest)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["command"][1:])
    assert (args.revision, args.expect_identity, args.digest) == (
        COMMIT_A, f"commit:{COMMIT_A}", digest)  # fmt: skip
    assert job["metadata"]["annotations"]["modelstage.io/source-identity"] == source.identity


# --- progress and the headline reason ---------------------------------------------------------


def test_the_latest_progress_line_is_taken_from_a_log_tail() -> None:
    log = (
        "hf: fetching 9 files of acme/llama\n"
        "staging sharded_state tp=2 to /mnt/x: 1.0 GiB / 4.0 GiB (25%), 3/23 tensors, 1.0 GiB/s\n"
        "staging sharded_state tp=2 to /mnt/x: 2.0 GiB / 4.0 GiB (50%), 9/23 tensors, 1.0 GiB/s\n"
        "some library warning\n"
    )
    assert progress_line(log).endswith("(50%), 9/23 tensors, 1.0 GiB/s")
    assert progress_line("nothing measured yet\n") == ""
    assert len(progress_line("x" * 1000 + " 5%")) <= 240


def test_staging_progress_says_what_the_cluster_and_the_log_know() -> None:
    def pod(name: str, phase: str, start: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "status": {"phase": phase, "startTime": start}}

    indexed = {"spec": {"completions": 4}, "status": {"succeeded": 1}}
    pods = [pod("w-1", "Running", "2026-03-01T12:01:00Z"), pod("w-0", "Succeeded", "2026-03-01T12:00:00Z"),
            pod("w-2", "Running", "2026-03-01T12:00:30Z")]  # fmt: skip
    assert staging_progress(indexed, pods) == (
        "1/4 workers done; running since 2026-03-01T12:00:30Z")  # fmt: skip
    log = "staging x: 1.0 GiB / 4.0 GiB (25%), 3/23 tensors, 1.0 GiB/s\n"
    assert staging_progress({"spec": {}}, pods[:1], log) == (
        "running since 2026-03-01T12:01:00Z; staging x: 1.0 GiB / 4.0 GiB (25%), 3/23 tensors, "
        "1.0 GiB/s")  # fmt: skip
    assert staging_progress({"spec": {}}, []) == ""


def test_the_staged_condition_carries_the_progress_and_how_to_follow_the_job(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec()
    desired = artifact_for(
        spec, namespace="llm", deployment_name="llama", identity=f"commit:{COMMIT_A}"
    )
    job = JobObservation("Running", name=stage_job_name(desired.digest),
                         progress="staging ...: 2.0 GiB / 4.0 GiB (50%)")  # fmt: skip
    d = decide(desired, ModelDeploymentStatus(), observed(job=job))
    staged = d.status.condition("Staged")
    assert staged is not None and staged.reason == "Staging"
    assert "2.0 GiB / 4.0 GiB (50%)" in staged.message
    assert f"kubectl logs -f job/{stage_job_name(desired.digest)}" in staged.message


def test_the_headline_reason_is_the_deciding_conditions(make_spec: SpecFactory) -> None:
    spec = make_spec()
    desired = artifact_for(
        spec, namespace="llm", deployment_name="llama", identity=f"commit:{COMMIT_A}"
    )
    staging = decide(desired, ModelDeploymentStatus(), observed(job=JobObservation("Running")))
    assert staging.status.reason == "Staging"
    failed = decide(
        desired, ModelDeploymentStatus(), observed(job=JobObservation("Failed", "error: x"))
    )
    assert failed.status.reason == "StagingFailed"
    assert headline([]) is None


def test_a_spec_that_cannot_be_staged_starts_no_resolve_job(make_spec: SpecFactory) -> None:
    from modelstage.operator.validation import Finding

    spec = make_spec(model={"revision": "main"})
    too_small = Finding("ClaimTooSmall", "use a larger claim", "staging")
    for s in (step(spec), step(spec, resolved_status(spec, COMMIT_A), now=T0 + timedelta(hours=1),
                               interval=60)):  # fmt: skip
        observed_ = Observed(generation=1, now=T0, findings=(too_small,))
        desired = None if s.source is None else artifact_for(
            spec, namespace="llm", deployment_name="llama", identity=s.source.identity)  # fmt: skip
        d = decide(desired, ModelDeploymentStatus(), observed_, s)
        assert (d.action, d.status.phase, d.status.reason) == (
            Action.WAIT,
            "Failed",
            "ClaimTooSmall",
        )


def test_a_stage_job_that_found_the_source_changed_makes_the_resolution_due(
    make_spec: SpecFactory,
) -> None:
    from modelstage.operator.resolve_plan import resolution_due, source_changed

    spec = make_spec(model={"revision": "main"})
    recorded = resolved_status(spec, COMMIT_A).source
    assert recorded is not None
    refusal = (f"error: hf://x changed since it was resolved: expected source identity "
               f"commit:{COMMIT_A}, found commit:{COMMIT_B}; resolve it again")  # fmt: skip
    after = T0 + timedelta(minutes=1)
    assert source_changed(JobObservation("Failed", refusal, after), recorded)
    assert not source_changed(JobObservation("Failed", "error: disk full", after), recorded)
    assert not source_changed(JobObservation("Running", refusal), recorded)
    # Resolved again after that failure and found unchanged: not again (no Job loop).
    assert not source_changed(
        JobObservation("Failed", refusal, T0 - timedelta(minutes=1)), recorded
    )
    same = refusal.replace(f"found commit:{COMMIT_B}", f"found commit:{COMMIT_A}")
    assert not source_changed(JobObservation("Failed", same, after), recorded)
    assert resolution_due(spec, recorded, now=T0, interval=0, stale=True)
    assert not resolution_due(spec, recorded, now=T0, interval=0)
    pinned = make_spec(model={"revision": COMMIT_A})
    assert not resolution_due(pinned, recorded, now=T0, interval=0, stale=True)


class LogKube:
    """The one call ``Observer.progress`` makes: a pod's log, or the API's refusal."""

    def __init__(self, log: str | None) -> None:
        self.log, self.reads = log, []  # type: list[tuple[str, dict[str, str]]]

    def text(self, path: str, query: dict[str, str]) -> str:
        from kubernetes.client.exceptions import ApiException

        self.reads.append((path, dict(query)))
        if self.log is None:
            raise ApiException(status=403, reason="pods/log is forbidden")
        return self.log


def test_the_stager_log_is_read_only_where_the_operator_may_read_it() -> None:
    from modelstage.operator.reconcile import Reconciler

    pods = [{"metadata": {"name": "stage-x"},
             "status": {"phase": "Running", "startTime": "2026-03-01T12:00:00Z"}}]  # fmt: skip
    log = "staging x: 1.0 GiB / 4.0 GiB (25%), 3/23 tensors, 1.0 GiB/s\n"
    quiet = LogKube(log)
    off = Reconciler(quiet, stager_image="x", post_event=lambda *_: None)  # type: ignore[arg-type]
    assert off.observer.progress("ns", {"spec": {}}, pods) == "running since 2026-03-01T12:00:00Z"
    assert quiet.reads == []
    allowed = LogKube(log)
    on = Reconciler(allowed, stager_image="x", post_event=lambda *_: None, stager_logs=True)  # type: ignore[arg-type]
    assert on.observer.progress("ns", {"spec": {}}, pods).endswith("(25%), 3/23 tensors, 1.0 GiB/s")
    assert allowed.reads == [("/api/v1/namespaces/ns/pods/stage-x/log",
                              {"container": "stager", "tailLines": "20"})]  # fmt: skip
    refused = Reconciler(LogKube(None), stager_image="x", post_event=lambda *_: None,  # type: ignore[arg-type]
                         stager_logs=True)  # fmt: skip
    assert refused.observer.progress("ns", {"spec": {}}, pods) == "running since 2026-03-01T12:00:00Z"


def test_a_resolve_job_this_model_deployment_does_not_own_is_not_believed(
    make_spec: SpecFactory,
) -> None:
    """Its name is predictable: a Job planted under it must not set the identity."""
    from modelstage.operator.reconcile import Reconciler

    spec = make_spec(model={"revision": "main"})
    name = resolve_job_name(spec, None, OWNER.name)
    planted = {"metadata": {"name": name, "ownerReferences": []},
               "status": {"conditions": [{"type": "Complete", "status": "True"}]}}  # fmt: skip

    class Kube:
        def get(self, path: str) -> dict[str, Any] | None:
            return planted if path.endswith(f"/jobs/{name}") else None

    reconciler = Reconciler(Kube(), stager_image="x", post_event=lambda *_: None)  # type: ignore[arg-type]
    got = reconciler.observer.resolve(spec, ModelDeploymentStatus(), OWNER, T0)
    assert (got.state, got.source) == ("failed", None)
    assert "does not own it" in got.message
