"""The state machine: each transition from spec + observed to the next action and status."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from modelstage.api.modeldeployment import (
    ArtifactStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
)
from modelstage.api.objects import DIGEST_ANNOTATION
from modelstage.operator.artifact import Artifact, artifact_for
from modelstage.operator.observations import (
    JobObservation,
    Observed,
    WorkloadObservation,
    observe_job,
    observe_workload,
    parse_summary,
    pod_failures,
    termination_message,
)
from modelstage.operator.state import (
    Action,
    Decision,
    decide,
    queued,
)
from modelstage.operator.validation import Finding

IDENTITY = "commit:" + "ab" * 20
"""A resolved source identity (a Hub commit) for planner tests."""

SpecFactory = Callable[..., ModelDeploymentSpec]
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "modelstage.io_modeldeployments.yaml"
STATUS_SCHEMA = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"][
    "openAPIV3Schema"
]["properties"]["status"]
OLD = ArtifactStatus(
    digest="0ld0ld0ld0ld0ld0ld00", uri="pvc://models/artifacts/llm/0ld0ld0ld0ld0ld0ld00",
    format="sharded_state", tensor_parallel_size=2,
)  # fmt: skip
NO_GPUS = Finding("InsufficientGPUs", "raise the GPU limit", "rollout")
RWO = Finding("ReadWriteOnceMultiNode", "use ReadWriteMany", "nothing")
BAD_VERSION = Finding("UnsupportedVllmVersion", "unknown vLLM version", "staging")
NOT_OPTED_IN = Finding(
    "TargetNotOptedIn", "add the annotation modelstage.io/model-deployment: llama", "rollout"
)


@pytest.fixture
def desired(make_spec: SpecFactory) -> Artifact:
    return artifact_for(make_spec(), namespace="llm", deployment_name="llama", identity=IDENTITY)


def summary(digest: str, **extra: Any) -> str:
    line = json.dumps(
        {"digest": digest, "source": "sha:4a1b", "bytes": 16_000_000_000, "seconds": 42.5, **extra}
    )
    return f"staging 32 tensors\nwrote rank 0\n{line}\n"


def run(
    desired: Artifact | None,
    status: ModelDeploymentStatus | None = None,
    *,
    job: JobObservation | None = None,
    workload: WorkloadObservation | None = None,
    findings: tuple[Finding, ...] = (),
    now: datetime = T0,
    generation: int = 1,
) -> Decision:
    observed = Observed(
        generation=generation, now=now, job=job, workload=workload, findings=findings
    )
    decision = decide(desired, status or ModelDeploymentStatus(), observed)
    jsonschema.Draft7Validator(STATUS_SCHEMA).validate(decision.status.wire())
    return decision


def cond(decision: Decision, type_: str) -> tuple[str, str]:
    found = decision.status.condition(type_)  # type: ignore[arg-type]
    assert found is not None, type_
    return found.status, found.reason


def on(digest: str | None, **kwargs: Any) -> WorkloadObservation:
    return WorkloadObservation(digest=digest, **kwargs)


def rolled_out(desired: Artifact, previous: ArtifactStatus | None = OLD) -> ModelDeploymentStatus:
    artifact = ArtifactStatus(
        digest=desired.digest,
        uri=desired.location.uri,
        format="sharded_state",
        tensor_parallel_size=2,
    )
    return ModelDeploymentStatus(phase="RollingOut", artifact=artifact, previous_artifact=previous)


def test_new_spec_creates_the_stager_job(desired: Artifact) -> None:
    d = run(desired, workload=on(None), generation=3)
    assert d.action is Action.CREATE_JOB
    assert d.status.phase == "Staging"
    assert cond(d, "Staged") == ("False", "JobCreated")
    assert cond(d, "Ready") == ("False", "NotRolledOut")
    assert cond(d, "Degraded") == ("False", "AsExpected")
    assert (d.status.observed_generation, d.status.desired_digest) == (3, desired.digest)


def test_running_job_is_waited_for(desired: Artifact) -> None:
    d = run(desired, job=JobObservation("Running"), workload=on(None))
    assert (d.action, d.status.phase, cond(d, "Staged")) == (
        Action.WAIT,
        "Staging",
        ("False", "Staging"),
    )


def test_failed_job_fails_with_the_stagers_last_line(desired: Artifact) -> None:
    message = (
        "loading config.json\nSpecError: tensor parallel size 3 does not divide 32 attention heads"
    )
    d = run(desired, job=JobObservation("Failed", message), workload=on(None))
    assert (d.action, d.status.phase) == (Action.WAIT, "Failed")
    staged = d.status.condition("Staged")
    assert staged is not None and staged.reason == "StagingFailed"
    assert staged.message == "SpecError: tensor parallel size 3 does not divide 32 attention heads"
    assert cond(d, "Degraded") == ("True", "StagingFailed")


def test_staged_artifact_is_recorded_and_rolled_out(desired: Artifact) -> None:
    status = ModelDeploymentStatus(phase="Ready", artifact=OLD)
    job = JobObservation(
        "Succeeded", summary(desired.digest, files=9), finished_at=T0 - timedelta(minutes=1)
    )
    d = run(desired, status, job=job, workload=on(OLD.digest))
    assert d.action is Action.ROLL_OUT
    assert d.status.phase == "RollingOut"
    assert d.artifact == d.status.artifact
    artifact = d.status.artifact
    assert artifact is not None
    assert (artifact.digest, artifact.uri, artifact.format, artifact.tensor_parallel_size) == (
        desired.digest, desired.location.uri, "sharded_state", 2,
    )  # fmt: skip
    assert (artifact.source, artifact.bytes, artifact.files, artifact.stage_seconds) == (
        "sha:4a1b",
        16_000_000_000,
        9,
        42.5,
    )
    assert artifact.staged_at == T0 - timedelta(minutes=1)
    assert d.status.previous_artifact == OLD
    assert cond(d, "Staged") == ("True", "Staged")
    staged = d.status.condition("Staged")
    assert staged is not None and "16.00 GB in 42 s" in staged.message


@pytest.mark.parametrize(
    ("workload", "findings", "degraded"),
    [
        (None, (Finding("TargetNotFound", "create it", "rollout"),), "TargetNotFound"),
        (on(None), (NO_GPUS,), "InsufficientGPUs"),
        (on(None), (NOT_OPTED_IN,), "TargetNotOptedIn"),
    ],
    ids=["no-workload", "not-enough-gpus", "not-opted-in"],
)
def test_staged_artifact_waits_while_the_rollout_is_blocked(
    desired: Artifact,
    workload: WorkloadObservation | None,
    findings: tuple[Finding, ...],
    degraded: str,
) -> None:
    job = JobObservation("Succeeded", summary(desired.digest))
    d = run(desired, job=job, workload=workload, findings=findings)
    assert (d.action, d.status.phase) == (Action.WAIT, "Staged")
    assert cond(d, "Staged") == ("True", "Staged")
    assert cond(d, "Degraded") == ("True", degraded)


def test_summary_with_another_digest_is_refused(desired: Artifact) -> None:
    d = run(
        desired, job=JobObservation("Succeeded", summary("ffffffffffffffffffff")), workload=on(None)
    )
    assert (d.action, d.status.phase) == (Action.WAIT, "Failed")
    assert cond(d, "Staged") == ("False", "ArtifactMismatch")
    assert d.status.artifact is None


def test_finished_rollout_is_ready(desired: Artifact) -> None:
    d = run(
        desired,
        rolled_out(desired),
        workload=on(desired.digest, replicas=2, updated=2, available=2),
    )
    assert (d.action, d.status.phase) == (Action.WAIT, "Ready")
    assert cond(d, "Ready") == ("True", "Serving")


def test_rollout_in_progress_reports_its_counts(desired: Artifact) -> None:
    d = run(
        desired,
        rolled_out(desired),
        workload=on(desired.digest, replicas=3, updated=1, available=2),
    )
    assert (d.action, d.status.phase) == (Action.WAIT, "RollingOut")
    ready = d.status.condition("Ready")
    assert (
        ready is not None
        and ready.status == "False"
        and "1/3 updated, 2 available" in ready.message
    )


def test_workload_controller_not_caught_up_is_still_rolling_out(desired: Artifact) -> None:
    d = run(
        desired,
        rolled_out(desired),
        workload=on(desired.digest, generation=5, observed_generation=4),
    )
    assert d.status.phase == "RollingOut"


def test_workload_never_seen_on_the_artifact_is_patched(desired: Artifact) -> None:
    """E.g. the operator was killed between writing the status and sending the patch."""
    d = run(desired, rolled_out(desired), workload=on(OLD.digest))
    assert (
        d.action is Action.ROLL_OUT
        and d.artifact is not None
        and d.artifact.digest == desired.digest
    )


def test_the_generation_a_workload_runs_the_artifact_at_is_recorded(desired: Artifact) -> None:
    d = run(desired, rolled_out(desired), workload=on(desired.digest, generation=7,
                                                      observed_generation=7))  # fmt: skip
    assert d.status.workload_generation == 7


def test_workload_changed_by_someone_else_is_reported_not_patched_back(desired: Artifact) -> None:
    status = rolled_out(desired).model_copy(update={"workload_generation": 4})
    d = run(desired, status, workload=on(None, generation=5))
    assert d.action is Action.WAIT and d.status.phase == "Staged"
    assert cond(d, "Degraded") == ("True", "WorkloadChanged")
    same_generation = run(desired, status, workload=on(None, generation=4))
    assert same_generation.action is Action.ROLL_OUT  # our own patch never landed


def test_a_new_artifact_forgets_the_old_workload_generation(make_spec: SpecFactory) -> None:
    """Rolling a new artifact is not fought as someone else's change."""
    new = artifact_for(
        make_spec(parallelism={"tensor": 4}),
        namespace="llm",
        deployment_name="llama",
        identity=IDENTITY,
    )
    old = ArtifactStatus(digest=OLD.digest, uri="pvc://x", format="sharded_state",
                         tensor_parallel_size=2)  # fmt: skip
    status = ModelDeploymentStatus(phase="Ready", artifact=old, workload_generation=4)
    assert status.workload_generation == 4
    job = JobObservation("Succeeded", summary(new.digest))
    d = run(new, status, job=job, workload=on(OLD.digest, generation=6))
    assert d.action is Action.ROLL_OUT and d.status.workload_generation is None


@pytest.mark.parametrize(
    "workload_kwargs",
    [{"failing": ("vllm-7d9f: CrashLoopBackOff (exit 1: Missing keys)",)}, {"stalled": True}],
    ids=["crash-loop", "progress-deadline"],
)
def test_failing_pods_roll_back_to_the_previous_artifact(
    desired: Artifact, workload_kwargs: dict[str, Any]
) -> None:
    d = run(
        desired, rolled_out(desired), workload=on(desired.digest, available=0, **workload_kwargs)
    )
    assert d.action is Action.ROLL_BACK and d.artifact == OLD
    assert d.status.phase == "Failed"
    assert d.status.artifact == OLD and d.status.previous_artifact is None
    assert d.status.failed_digest == desired.digest
    assert cond(d, "Degraded") == ("True", "RolledBack")
    degraded = d.status.condition("Degraded")
    assert (
        degraded is not None
        and OLD.digest in degraded.message
        and "change the spec" in degraded.message
    )


def test_after_a_rollback_the_failed_digest_is_not_retried(desired: Artifact) -> None:
    first = run(desired, rolled_out(desired), workload=on(desired.digest, failing=("crash",)))
    later = run(desired, first.status, workload=on(OLD.digest), now=T0 + timedelta(minutes=5))
    assert (later.action, later.status.phase) == (Action.WAIT, "Failed")
    assert cond(later, "Ready") == ("True", "Serving")
    assert cond(later, "Degraded") == ("True", "RolledBack")


def test_the_pods_failure_reason_survives_the_reconciliations_after_a_rollback(
    desired: Artifact,
) -> None:
    """The rollback patch itself wakes the operator again, and by then the failing pods are
    gone: the Degraded message must still say why they failed."""
    why = "pod vllm-7d9f, container vllm: CrashLoopBackOff: RuntimeError: CUDA out of memory"
    first = run(desired, rolled_out(desired), workload=on(desired.digest, failing=(why,)))
    later = run(desired, first.status, workload=on(OLD.digest), now=T0 + timedelta(minutes=1))
    degraded = later.status.condition("Degraded")
    assert degraded is not None and why in degraded.message and OLD.digest in degraded.message
    assert later.status.failure_reason == why


def test_a_rollback_that_was_not_applied_is_applied_again(desired: Artifact) -> None:
    first = run(desired, rolled_out(desired), workload=on(desired.digest, failing=("crash",)))
    again = run(desired, first.status, workload=on(desired.digest, failing=("crash",)))
    assert again.action is Action.ROLL_BACK and again.artifact == OLD


def test_a_workload_that_withdrew_its_opt_in_is_neither_rolled_out_nor_back(
    desired: Artifact,
) -> None:
    serving_old = run(
        desired, rolled_out(desired), workload=on(OLD.digest), findings=(NOT_OPTED_IN,)
    )
    assert (serving_old.action, serving_old.status.phase) == (Action.WAIT, "Staged")
    assert cond(serving_old, "Ready") == ("False", "TargetNotOptedIn")
    assert cond(serving_old, "Degraded") == ("True", "TargetNotOptedIn")
    first = run(desired, rolled_out(desired), workload=on(desired.digest, failing=("crash",)))
    again = run(desired, first.status, workload=on(desired.digest, failing=("crash",)),
                findings=(NOT_OPTED_IN,))  # fmt: skip
    assert again.action is Action.WAIT
    assert "modelstage.io/model-deployment" in again.status.condition("Degraded").message  # type: ignore[union-attr]


def test_a_spec_change_after_a_rollback_stages_again(
    make_spec: SpecFactory, desired: Artifact
) -> None:
    first = run(desired, rolled_out(desired), workload=on(desired.digest, failing=("crash",)))
    changed = artifact_for(
        make_spec(dtype="float16"), namespace="llm", deployment_name="llama", identity=IDENTITY
    )
    d = run(changed, first.status, workload=on(OLD.digest), generation=2)
    assert d.action is Action.CREATE_JOB and d.status.failed_digest is None
    assert d.status.failure_reason is None


def test_failing_pods_without_a_previous_artifact_fail_without_rollback(desired: Artifact) -> None:
    d = run(
        desired,
        rolled_out(desired, previous=None),
        workload=on(desired.digest, failing=("OOMKilled",)),
    )
    assert (d.action, d.status.phase) == (Action.WAIT, "Failed")
    assert cond(d, "Degraded") == ("True", "RolloutFailed")


def test_spec_that_cannot_be_staged_fails_without_action(desired: Artifact) -> None:
    for artifact in (None, desired):
        d = run(artifact, findings=(BAD_VERSION,), workload=on(None))
        assert (d.action, d.status.phase) == (Action.WAIT, "Failed")
        assert cond(d, "Staged") == ("False", "UnsupportedVllmVersion")
        assert cond(d, "Degraded") == ("True", "UnsupportedVllmVersion")


def test_a_warning_degrades_but_does_not_stop_readiness(desired: Artifact) -> None:
    d = run(desired, rolled_out(desired), workload=on(desired.digest), findings=(RWO,))
    assert d.status.phase == "Ready"
    assert cond(d, "Degraded") == ("True", "ReadWriteOnceMultiNode")


def test_the_old_artifact_keeps_serving_while_a_new_one_stages(make_spec: SpecFactory) -> None:
    new = artifact_for(
        make_spec(parallelism={"tensor": 4}),
        namespace="llm",
        deployment_name="llama",
        identity=IDENTITY,
    )
    status = ModelDeploymentStatus(phase="Ready", artifact=OLD)
    d = run(new, status, workload=on(OLD.digest), generation=2)
    assert (d.action, d.status.phase) == (Action.CREATE_JOB, "Staging")
    assert cond(d, "Ready") == ("True", "Serving")
    assert d.status.artifact == OLD


def test_transition_time_moves_only_when_a_condition_status_changes(desired: Artifact) -> None:
    first = run(desired, job=JobObservation("Running"), workload=on(None))
    second = run(
        desired,
        first.status,
        job=JobObservation("Running"),
        workload=on(None),
        now=T0 + timedelta(hours=1),
    )
    staged = second.status.condition("Staged")
    assert staged is not None and staged.last_transition_time == T0
    succeeded = JobObservation("Succeeded", summary(desired.digest))
    done = run(desired, second.status, job=succeeded, workload=None, now=T0 + timedelta(hours=2))
    staged = done.status.condition("Staged")
    assert staged is not None and staged.last_transition_time == T0 + timedelta(hours=2)


def test_deciding_is_deterministic(desired: Artifact) -> None:
    args = {"job": JobObservation("Succeeded", summary(desired.digest)), "workload": on(None)}
    assert run(desired, **args) == run(desired, **args)


def test_observe_job_reads_conditions_and_completion_time() -> None:
    done = {
        "status": {
            "conditions": [{"type": "Complete", "status": "True"}],
            "completionTime": "2026-03-01T11:59:00Z",
        }
    }
    assert observe_job(done, "x") == JobObservation("Succeeded", "x", T0 - timedelta(minutes=1))
    failed = {
        "status": {
            "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
        }
    }
    assert observe_job(failed) == JobObservation("Failed", "BackoffLimitExceeded")
    assert observe_job({"status": {"active": 1}}).state == "Running"
    assert (
        observe_job({"status": {"conditions": [{"type": "Failed", "status": "False"}]}}).state
        == "Running"
    )


def test_observe_workload_reads_the_digest_and_rollout_counts() -> None:
    workload = {
        "metadata": {"generation": 4},
        "spec": {
            "replicas": 3,
            "template": {"metadata": {"annotations": {"modelstage.io/artifact-digest": "abc"}}},
        },
        "status": {
            "observedGeneration": 4, "updatedReplicas": 3, "availableReplicas": 2,
            "conditions": [
                {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
            ],
        },
    }  # fmt: skip
    seen = observe_workload(workload, ["pod-1: CrashLoopBackOff"])
    assert seen == WorkloadObservation(
        digest="abc", generation=4, observed_generation=4, replicas=3, updated=3, available=2,
        failing=("pod-1: CrashLoopBackOff",), stalled=True,
    )  # fmt: skip
    assert not seen.complete


@pytest.mark.parametrize("line", ["[" * 5000, '{"digest": 1' + "0" * 5000 + "}", '{"a":' * 5000])
def test_a_termination_message_that_is_no_json_is_no_summary(line: str) -> None:
    """A pod writes what it likes there: deep nesting or endless digits are not a crash."""
    assert parse_summary(f"staging\n{line}") is None


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ('log line\n{"digest": "abc", "bytes": 1}\n', {"digest": "abc", "bytes": 1}),
        ("CheckpointError: config.json missing", None),
        ('{"no_digest": 1}', None),
        ("", None),
    ],
)
def test_parse_summary_takes_the_json_last_line(
    message: str, expected: dict[str, Any] | None
) -> None:
    assert parse_summary(message) == expected


def _pod(
    name: str, digest: str | None, statuses: list[dict[str, Any]], phase: str = "Running"
) -> dict[str, Any]:
    annotations = {DIGEST_ANNOTATION: digest} if digest else {}
    return {
        "metadata": {"name": name, "annotations": annotations},
        "status": {"phase": phase, "containerStatuses": statuses},
    }


def test_pod_failures_names_crash_looping_containers_of_the_digest_only() -> None:
    crash = {
        "name": "vllm",
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {
            "terminated": {"exitCode": 1, "message": "boot\nRuntimeError: out of memory"}
        },
    }
    running = {"name": "vllm", "state": {"running": {}}}
    pods = [_pod("new", "d2", [crash]), _pod("old", "d1", [crash]), _pod("ok", "d2", [running])]
    assert pod_failures(pods, "d2") == (
        "pod new, container vllm: CrashLoopBackOff: RuntimeError: out of memory",
    )
    assert pod_failures(pods, None) == ()


def test_termination_message_prefers_the_summary_on_success_and_the_error_on_failure() -> None:
    def term(code: int, message: str, at: str) -> dict[str, Any]:
        return {
            "name": "stager",
            "state": {"terminated": {"exitCode": code, "message": message, "finishedAt": at}},
        }

    summary = '{"digest": "d1", "source": "sha:1"}'
    pods = [
        _pod("a", None, [term(1, "first failure", "2030-01-01T00:00:01Z")]),
        _pod("b", None, [term(1, "last failure", "2030-01-01T00:00:03Z")]),
        _pod("c", None, [term(0, summary, "2030-01-01T00:00:02Z")]),
        _pod("d", None, [term(0, "done", "2030-01-01T00:00:04Z")]),
    ]
    assert termination_message(pods, success=True) == summary
    assert termination_message(pods, success=False) == "last failure"
    assert termination_message([], success=False) == ""


def test_a_staging_without_a_slot_waits_queued_with_its_position(desired: Artifact) -> None:
    observed = Observed(generation=2, now=T0, workload=on(None))
    d = queued(run(desired, workload=on(None), generation=2), 3, 4, observed)
    assert (d.action, d.status.phase, d.status.queue_position) == (Action.WAIT, "Pending", 3)
    assert cond(d, "Staged") == ("False", "Queued")
    staged = d.status.condition("Staged")
    assert staged is not None and "position 3" in staged.message and "at most 4" in staged.message
    jsonschema.Draft7Validator(STATUS_SCHEMA).validate(d.status.wire())
    admitted = run(desired, d.status, workload=on(None), generation=2)
    assert admitted.action is Action.CREATE_JOB and admitted.status.queue_position is None
