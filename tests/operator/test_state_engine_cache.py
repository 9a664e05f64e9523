"""The state machine with ``spec.engineCache``: the roll waits for the capture until its
deadline, a failed or late capture never fails the ModelDeployment, and a changed engine
argument or vLLM image captures again and rolls the workload onto the new cache."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from modelstage.api.modeldeployment import (
    ArtifactStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
)
from modelstage.api.objects import Owner
from modelstage.operator.artifact import Artifact, artifact_for
from modelstage.operator.engine_cache_plan import (
    CaptureInputs,
    capture_inputs,
    plan_capture_job,
    plan_engine_cache,
)
from modelstage.operator.observations import (
    EngineCacheStep,
    JobObservation,
    Observed,
    WorkloadObservation,
)
from modelstage.operator.state import Action, Decision, decide

from .conftest import SpecFactory

IDENTITY = "commit:" + "ef" * 20
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OWNER = Owner(name="llama", namespace="llm", uid="uid-1")
CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "modelstage.io_modeldeployments.yaml"
STATUS_SCHEMA = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"][
    "openAPIV3Schema"
]["properties"]["status"]
CAPTURED = json.dumps({
    "key": "k", "files": 3, "bytes": 1000, "hardware": {"kind": "cpu", "isa": ["avx2"]},
    "config": {"vllmVersion": "0.32.0", "torchVersion": "2.13.0", "modelPath": "/m",
               "engineArgs": {"maxModelLen": 8192}, "environment": {}},
})  # fmt: skip


def spec_of(make_spec: SpecFactory, enabled: bool = True) -> ModelDeploymentSpec:
    return make_spec(parallelism={"tensor": 4},
                     engineCache={"enabled": enabled, "deadlineSeconds": 600})  # fmt: skip


def art(spec: ModelDeploymentSpec) -> Artifact:
    return artifact_for(spec, namespace="llm", deployment_name="llama", identity=IDENTITY)


def staged(a: Artifact) -> ArtifactStatus:
    return ArtifactStatus(digest=a.digest, uri=a.location.uri, format="sharded_state",
                          tensor_parallel_size=4)  # fmt: skip


def step(
    spec: ModelDeploymentSpec,
    workload: dict[str, Any],
    status: ModelDeploymentStatus,
    job: JobObservation | None = None,
    now: datetime = T0,
) -> EngineCacheStep:
    a = art(spec)
    inputs = capture_inputs(spec, a, workload)
    assert isinstance(inputs, CaptureInputs), inputs
    planned = plan_capture_job(spec, a, inputs, owner=OWNER)
    return plan_engine_cache(spec.engine_cache, a, inputs, before=status.engine_cache,
                             job=job, planned=planned, now=now)  # fmt: skip


def run(
    spec: ModelDeploymentSpec,
    status: ModelDeploymentStatus,
    engine: EngineCacheStep | None,
    *,
    workload: WorkloadObservation,
    stage_job: JobObservation | None = None,
    now: datetime = T0,
) -> Decision:
    observed = Observed(
        generation=1, now=now, job=stage_job, workload=workload,
        engine_cache_enabled=spec.engine_cache.enabled, engine_cache=engine,
    )  # fmt: skip
    decision = decide(art(spec), status, observed)
    jsonschema.Draft7Validator(STATUS_SCHEMA).validate(decision.status.wire())
    return decision


def cond(decision: Decision, type_: str) -> tuple[str, str] | None:
    found = decision.status.condition(type_)  # type: ignore[arg-type]
    return (found.status, found.reason) if found is not None else None


def stage_done(a: Artifact) -> JobObservation:
    line = json.dumps({"digest": a.digest, "bytes": 10, "files": 2, "seconds": 1.0})
    return JobObservation("Succeeded", line, T0)


def with_args(deployment: dict[str, Any], *extra: str, image: str | None = None) -> dict[str, Any]:
    workload = copy.deepcopy(deployment)
    vllm = next(
        c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"
    )
    vllm["args"] = [*vllm["args"], *extra]
    if image:
        vllm["image"] = image
    return workload


def test_staged_waits_for_the_capture_then_rolls_with_the_cache(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = spec_of(make_spec)
    a = art(spec)
    first = step(spec, deployment, ModelDeploymentStatus())
    d = run(spec, ModelDeploymentStatus(), first, workload=WorkloadObservation(None),
            stage_job=stage_done(a))  # fmt: skip
    assert d.action is Action.CREATE_CAPTURE_JOB and d.status.phase == "Staged"
    assert d.status.reason == "Capturing"
    assert d.status.artifact is not None and d.status.artifact.digest == a.digest
    assert cond(d, "EngineCached") == ("False", "Capturing")
    assert d.status.engine_cache is not None and d.status.engine_cache.phase == "Capturing"

    running = step(spec, deployment, d.status, JobObservation("Running", name="cap"))
    d = run(spec, d.status, running, workload=WorkloadObservation(None))
    assert (d.action, d.status.phase) == (Action.WAIT, "Staged")

    done = step(spec, deployment, d.status, JobObservation("Succeeded", CAPTURED))
    d = run(spec, d.status, done, workload=WorkloadObservation(None))
    assert d.action is Action.ROLL_OUT and d.status.phase == "RollingOut"
    assert cond(d, "EngineCached") == ("True", "Captured")
    assert d.status.engine_cache is not None and d.status.engine_cache.phase == "Captured"
    assert d.status.engine_cache.config is not None


def test_past_the_deadline_it_rolls_without_and_never_fails(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = spec_of(make_spec)
    status = ModelDeploymentStatus(phase="Staged", artifact=staged(art(spec)))
    first = step(spec, deployment, status)
    status = run(spec, status, first, workload=WorkloadObservation(None)).status
    late = T0 + timedelta(seconds=600)
    d = run(spec, status, step(spec, deployment, status, JobObservation("Running"), late),
            workload=WorkloadObservation(None), now=late)  # fmt: skip
    assert d.action is Action.ROLL_OUT and d.status.phase == "RollingOut"
    assert cond(d, "EngineCached") == ("False", "DeadlinePassed")
    assert cond(d, "Degraded") == ("False", "AsExpected")
    failed = step(spec, deployment, status, JobObservation("Failed", "error: out of memory"))
    d = run(spec, status, failed, workload=WorkloadObservation(None))
    assert d.action is Action.ROLL_OUT and d.status.phase != "Failed"
    assert cond(d, "EngineCached") == ("False", "CaptureFailed")


def _served(
    spec: ModelDeploymentSpec, deployment: dict[str, Any]
) -> tuple[ModelDeploymentStatus, str]:
    """Rolled out and serving with the captured cache: the status and the cache's URI."""
    status = ModelDeploymentStatus(phase="RollingOut", artifact=staged(art(spec)))
    first = step(spec, deployment, status)
    status = run(spec, status, first, workload=WorkloadObservation(None)).status
    done = step(spec, deployment, status, JobObservation("Succeeded", CAPTURED))
    status = run(spec, status, done, workload=WorkloadObservation(None)).status
    assert status.engine_cache is not None
    return status, status.engine_cache.uri


def test_a_changed_engine_argument_captures_again_and_rolls_onto_the_new_cache(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = spec_of(make_spec)
    status, old = _served(spec, deployment)
    a = art(spec)
    serving = WorkloadObservation(a.digest, engine_cache=old)
    assert run(spec, status, step(spec, deployment, status), workload=serving).action is Action.WAIT

    edited = with_args(deployment, "--max-model-len", "4096")
    again = step(spec, edited, status, now=T0 + timedelta(hours=1))
    d = run(spec, status, again, workload=serving, now=T0 + timedelta(hours=1))
    assert d.action is Action.CREATE_CAPTURE_JOB  # the pods keep the old cache meanwhile
    assert d.status.engine_cache is not None and d.status.engine_cache.uri != old
    new = step(spec, edited, d.status, JobObservation("Succeeded", CAPTURED))
    d = run(spec, d.status, new, workload=serving)
    assert d.action is Action.ROLL_OUT and new.use is not None and new.use.uri != old
    assert new.use.uri in d.details


def test_a_changed_vllm_image_captures_again(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = spec_of(make_spec)
    status, old = _served(spec, deployment)
    serving = WorkloadObservation(art(spec).digest, engine_cache=old)
    upgraded = with_args(deployment, image="vllm/vllm-openai:v0.32.1")
    d = run(spec, status, step(spec, upgraded, status), workload=serving)
    assert d.action is Action.CREATE_CAPTURE_JOB
    failed = step(spec, upgraded, d.status, JobObservation("Failed", "error: no GPU"))
    d = run(spec, d.status, failed, workload=serving)
    # The old cache is not this image's: the workload is rolled off it, not failed.
    assert d.action is Action.ROLL_OUT and d.status.phase != "Failed"


def test_a_workload_rolled_without_a_cache_is_not_restarted_for_a_late_one(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = spec_of(make_spec)
    status, _ = _served(spec, deployment)
    done = step(spec, deployment, status)
    d = run(spec, status, done, workload=WorkloadObservation(art(spec).digest, engine_cache=None))
    assert d.action is Action.WAIT and d.status.phase == "Ready"


def test_turning_the_engine_cache_off_rolls_it_away_and_clears_the_status(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    on = spec_of(make_spec)
    status, old = _served(on, deployment)
    off = spec_of(make_spec, enabled=False)
    d = run(off, status, None, workload=WorkloadObservation(art(off).digest, engine_cache=old))
    assert d.action is Action.ROLL_OUT
    assert d.status.engine_cache is None and cond(d, "EngineCached") is None
