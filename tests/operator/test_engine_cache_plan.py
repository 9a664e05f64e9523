"""``spec + artifact + workload -> capture Job`` and where the engine cache stands: what the
operator reads of vLLM's key from the workload, the address it derives, the capture Job it
runs, the step before the roll, and what the roll gives the serving pods' prepare."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes_validate
import pytest
from modelstage.api.modeldeployment import EngineCache, EngineCacheStatus, ModelDeploymentSpec
from modelstage.api.objects import Owner
from modelstage.core.engine_cache import ROOTS
from modelstage.operator.artifact import ARTIFACT_MOUNT, Artifact, artifact_for
from modelstage.operator.engine_cache_plan import (
    CAPTURE_DEFAULT_ENV,
    CaptureInputs,
    Unavailable,
    cache_path,
    cache_uri,
    capture_inputs,
    capture_job_name,
    plan_capture_job,
    plan_engine_cache,
)
from modelstage.operator.kube import ENGINE_CACHE_ANNOTATION, ENGINE_CACHE_DIR
from modelstage.operator.observations import JobObservation, parse_capture
from modelstage.operator.patch import apply_merge_patch
from modelstage.operator.rollout_plan import EngineCacheUse, plan_rollout
from modelstage.stager.engine_capture import DEFAULT_ENV

from .conftest import SpecFactory

IDENTITY = "commit:" + "cd" * 20
OWNER = Owner(name="llama", namespace="llm", uid="uid-1")
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CONFIG = {"vllmVersion": "0.32.0", "torchVersion": "2.13.0+cpu", "modelPath": "/m",
          "engineArgs": {"maxModelLen": 8192}, "environment": {"VLLM_USE_AOT_COMPILE": "0"}}  # fmt: skip
CPU = {"kind": "cpu", "arch": "x86_64", "isa": ["avx2"], "gpu": "", "capability": ""}
GPU = {"kind": "gpu", "arch": "", "isa": [], "gpu": "NVIDIA H200", "capability": "9.0"}


def enabled(make_spec: SpecFactory, **engine: Any) -> ModelDeploymentSpec:
    return make_spec(parallelism={"tensor": 4}, engineCache={"enabled": True, **engine})


def art(spec: ModelDeploymentSpec) -> Artifact:
    return artifact_for(spec, namespace="llm", deployment_name="llama", identity=IDENTITY)


def container(workload: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(
        c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"
    )
    return found


def with_args(deployment: dict[str, Any], *extra: str, image: str | None = None) -> dict[str, Any]:
    workload = copy.deepcopy(deployment)
    c = container(workload)
    c["args"] = [*c["args"], *extra]
    if image is not None:
        c["image"] = image
    return workload


def inputs_of(spec: ModelDeploymentSpec, workload: dict[str, Any]) -> CaptureInputs:
    found = capture_inputs(spec, art(spec), workload)
    assert isinstance(found, CaptureInputs), found
    return found


def test_the_capture_default_environment_is_the_capture_commands() -> None:
    assert CAPTURE_DEFAULT_ENV == DEFAULT_ENV


def test_engine_arguments_are_read_from_the_vllm_command_line(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    workload = with_args(deployment, "--dtype", "bfloat16", "-q=fp8",
                         "--compilation-config", '{"level": 3, "cudagraph_mode": "FULL"}')  # fmt: skip
    args = inputs_of(spec, workload).engine_args
    assert (args.maxModelLen, args.tensorParallelSize, args.pipelineParallelSize) == (8192, 4, 1)
    assert (args.dtype, args.quantization, args.enforceEager) == ("bfloat16", "fp8", False)
    assert args.compilationConfig == '{"cudagraph_mode":"FULL","level":3}'
    assert args.loadFormat == "modelstage_sharded_state"  # what the roll sets
    assert inputs_of(spec, with_args(deployment, "-O3")).engine_args.compilationConfig == "3"


def test_an_eager_engine_has_nothing_to_capture_and_says_so_without_a_finding(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    found = capture_inputs(spec, art(spec), with_args(deployment, "--enforce-eager"))
    assert isinstance(found, Unavailable)
    assert (found.reason, found.finding) == ("NothingToCompile", False)
    assert "--enforce-eager" in found.message
    turned_back = with_args(deployment, "--enforce-eager", "--no-enforce-eager")
    assert isinstance(capture_inputs(spec, art(spec), turned_back), CaptureInputs)


@pytest.mark.parametrize(
    ("change", "reason", "says"),
    [
        ({"serving": {"plugin": False}}, "EngineCacheNeedsPlugin", "plugin: true"),
    ],
)  # fmt: skip
def test_what_the_spec_cannot_capture_for_is_a_finding(
    make_spec: SpecFactory, deployment: dict[str, Any], change: dict[str, Any], reason: str,
    says: str,
) -> None:  # fmt: skip
    spec = make_spec(engineCache={"enabled": True}, **change)
    found = capture_inputs(spec, art(spec), deployment)
    assert isinstance(found, Unavailable) and found.finding
    assert found.reason == reason and says in found.message


def test_a_workload_without_max_model_len_gets_no_capture(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    workload = copy.deepcopy(deployment)
    c = container(workload)
    i = c["args"].index("--max-model-len")
    del c["args"][i : i + 2]
    found = capture_inputs(spec, art(spec), workload)
    assert isinstance(found, Unavailable) and found.reason == "EngineCacheArgs"
    assert "--max-model-len" in found.message


def test_an_image_whose_vllm_release_is_unknown_gets_no_capture(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    latest = with_args(deployment, image="vllm/vllm-openai:latest")
    found = capture_inputs(spec, art(spec), latest)
    assert isinstance(found, Unavailable) and found.reason == "EngineCacheImageUnknown"
    assert "vllm/vllm-openai:latest" in found.message
    told = make_spec(parallelism={"tensor": 4}, engineCache={"enabled": True},
                     serving={"vllmVersion": "0.32"})  # fmt: skip
    assert isinstance(capture_inputs(told, art(told), latest), CaptureInputs)


def test_the_key_moves_with_every_engine_input_and_the_address_with_the_key(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    digest = art(spec).digest
    base = inputs_of(spec, deployment).key(digest)
    assert inputs_of(spec, copy.deepcopy(deployment)).key(digest) == base  # pure
    changed = {
        "max-model-len": inputs_of(spec, with_args(deployment, "--max-model-len", "4096")),
        "image": inputs_of(spec, with_args(deployment, image="vllm/vllm-openai:v0.32.1")),
        "env": inputs_of(spec, _with_env(deployment, "VLLM_CPU_OMP_THREADS_BIND", "0|1")),
        "node class": inputs_of(
            enabled(make_spec, capture={"nodeSelector": {"gpu": "h200"}}), deployment
        ),
    }
    keys = {name: i.key(digest) for name, i in changed.items()}
    assert base not in keys.values() and len(set(keys.values())) == len(keys), keys
    assert inputs_of(spec, deployment).key("f" * 20) != base  # another artifact
    a = art(spec)
    assert cache_path(a, base) == f"{a.location.path}.engine-{base}"
    assert cache_uri(a, base) == f"{a.location.uri}.engine-{base}"
    assert cache_path(a, base).startswith(f"{ARTIFACT_MOUNT}/artifacts/llm/")


def _with_env(deployment: dict[str, Any], name: str, value: str) -> dict[str, Any]:
    workload = copy.deepcopy(deployment)
    container(workload).setdefault("env", []).append({"name": name, "value": value})
    return workload


def test_the_capture_job_runs_the_serving_image_restricted_on_the_serving_class(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec, deadlineSeconds=900)
    workload = _with_env(deployment, "VLLM_CPU_KVCACHE_SPACE", "4")
    workload["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "h200"}
    workload["spec"]["template"]["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    a, inputs = art(spec), inputs_of(spec, workload)
    job = plan_capture_job(spec, a, inputs, owner=OWNER, default_image="stager:1")
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    key = inputs.key(a.digest)
    assert job["metadata"]["name"] == capture_job_name(key)
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert job["spec"]["activeDeadlineSeconds"] == 900 and job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    (install,) = pod["initContainers"]
    (capture,) = pod["containers"]
    assert install["image"] == "stager:1" and "--install-capture" in install["command"]
    assert capture["image"] == "vllm/vllm-openai:v0.32.0"
    assert capture["resources"] == container(workload)["resources"]
    for c in (install, capture):
        ctx = c["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["runAsNonRoot"] is True
        assert ctx["capabilities"] == {"drop": ["ALL"]}
    cmd = capture["command"]
    assert cmd[:4] == ["python3", "-m", "modelstage.stager.cli", "capture-engine-cache"]
    assert cmd[cmd.index("--artifact") + 1] == a.location.path
    assert cmd[cmd.index("--out") + 1] == cache_path(a, key)
    assert json.loads(cmd[cmd.index("--engine-args") + 1]) == inputs.engine_args.to_doc()
    env = {e["name"]: e["value"] for e in capture["env"]}
    assert env["PYTHONPATH"] == "/opt/modelstage/plugins"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_USE_AOT_COMPILE"] == "0"
    assert "HF_TOKEN" not in env  # only the compile environment is carried


def test_the_capture_section_overrides_the_workloads_placement(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    capture = {"nodeSelector": {"pool": "capture"}, "resources": {"limits": {"cpu": "8"}},
               "tolerations": [{"key": "capture", "operator": "Exists"}]}  # fmt: skip
    spec = enabled(make_spec, capture=capture, deadlineSeconds=0)
    job = plan_capture_job(spec, art(spec), inputs_of(spec, deployment), owner=OWNER)
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "capture"}
    assert pod["tolerations"] == [{"key": "capture", "operator": "Exists"}]
    assert pod["containers"][0]["resources"] == {"limits": {"cpu": "8"}}
    assert job["spec"]["activeDeadlineSeconds"] == 60  # a Job's deadline is never zero


# --- the step before the roll ------------------------------------------------------------------


def step_for(
    spec: ModelDeploymentSpec,
    workload: dict[str, Any],
    *,
    before: EngineCacheStatus | None = None,
    job: JobObservation | None = None,
    now: datetime = T0,
) -> Any:
    a = art(spec)
    found = capture_inputs(spec, a, workload)
    planned = (
        plan_capture_job(spec, a, found, owner=OWNER) if isinstance(found, CaptureInputs) else None
    )
    return plan_engine_cache(spec.engine_cache, a, found, before=before, job=job,
                             planned=planned, now=now)  # fmt: skip


def captured_line(hardware: dict[str, Any] = CPU) -> str:
    summary = {"engineCache": "/x", "key": "k", "files": 12, "bytes": 3_500_000,
               "config": CONFIG, "hardware": hardware}  # fmt: skip
    return "compiling\n" + json.dumps(summary)


def test_a_capture_is_created_then_waited_for_then_used(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    first = step_for(spec, deployment)
    assert first.create is not None and not first.roll
    assert first.condition[:2] == ("False", "Capturing")
    assert first.status.phase == "Capturing" and first.status.since == T0
    running = step_for(spec, deployment, before=first.status, job=JobObservation("Running"),
                       now=T0 + timedelta(minutes=5))  # fmt: skip
    assert running.create is None and not running.roll and running.status.since == T0
    done = step_for(spec, deployment, before=running.status,
                    job=JobObservation("Succeeded", captured_line()))  # fmt: skip
    assert done.roll and done.condition[:2] == ("True", "Captured")
    assert done.status.phase == "Captured" and json.loads(done.status.config) == CONFIG
    assert done.use is not None and done.use.uri == done.status.uri
    assert done.use.hardware is None  # a CPU: prepare measures its own node
    assert done.status.uri in done.condition[2]
    # Its Job gone (a TTL, a hand), the captured cache is still used: it is on the storage.
    later = step_for(spec, deployment, before=done.status)
    assert later.use == done.use and later.create is None


def test_a_gpu_class_is_handed_to_prepare(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    done = step_for(spec, deployment, job=JobObservation("Succeeded", captured_line(GPU)))
    assert done.use is not None and json.loads(done.use.hardware) == GPU


def test_a_capture_past_its_deadline_rolls_without_the_cache(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec, deadlineSeconds=600)
    first = step_for(spec, deployment)
    late = step_for(spec, deployment, before=first.status, job=JobObservation("Running"),
                    now=T0 + timedelta(seconds=600))  # fmt: skip
    assert late.roll and late.use is None and late.create is None
    assert late.condition[:2] == ("False", "DeadlinePassed")
    assert late.status.phase == "DeadlinePassed" and "600 s" in late.status.reason


def test_a_failed_capture_rolls_without_the_cache_and_says_why(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    message = "loading\nerror: /m: vLLM failed (exit 1): out of memory"
    failed = step_for(spec, deployment, job=JobObservation("Failed", message))
    assert failed.roll and failed.use is None
    assert failed.condition[:2] == ("False", "CaptureFailed")
    assert failed.status.reason == "error: /m: vLLM failed (exit 1): out of memory"
    no_config = step_for(spec, deployment, job=JobObservation("Succeeded", '{"key": "k"}'))
    assert no_config.roll and no_config.use is None and no_config.status.phase == "Failed"


def test_a_changed_engine_argument_or_image_is_a_new_capture(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    done = step_for(spec, deployment, job=JobObservation("Succeeded", captured_line()))
    for workload in (with_args(deployment, "--max-model-len", "4096"),
                     with_args(deployment, image="vllm/vllm-openai:v0.32.1")):  # fmt: skip
        again = step_for(spec, workload, before=done.status, now=T0 + timedelta(hours=1))
        assert again.status.key != done.status.key and again.status.uri != done.status.uri
        assert again.create is not None and again.use is None and not again.roll
        assert again.status.since == T0 + timedelta(hours=1)  # its own deadline


def test_parse_capture_wants_the_configuration_and_the_hardware() -> None:
    assert parse_capture(captured_line()) is not None
    assert parse_capture('{"key": "k", "config": {}}') is None
    assert parse_capture("not json") is None
    assert parse_capture("") is None


# --- what the roll gives the serving pods -------------------------------------------------------


def use(hardware: str | None = None) -> EngineCacheUse:
    return EngineCacheUse(path=f"{ARTIFACT_MOUNT}/x.engine-k", uri="pvc://models/x.engine-k",
                          config=json.dumps(CONFIG), hardware=hardware,
                          env=(("VLLM_USE_AOT_COMPILE", "0"),))  # fmt: skip


def rolled(spec: ModelDeploymentSpec, workload: dict[str, Any], engine: EngineCacheUse | None
           ) -> dict[str, Any]:  # fmt: skip
    plan = plan_rollout(spec, art(spec), workload, engine_cache=engine)
    patched: dict[str, Any] = apply_merge_patch(workload, plan.merge_patch)
    return patched


def test_the_roll_gives_prepare_the_cache_and_vllm_the_cache_roots(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    workload = rolled(spec, deployment, use())
    kubernetes_validate.validate(workload, kubernetes_validate.latest_version(), strict=True)
    template = workload["spec"]["template"]
    assert template["metadata"]["annotations"][ENGINE_CACHE_ANNOTATION] == "pvc://models/x.engine-k"
    pod = template["spec"]
    (prepare,) = pod["initContainers"]
    cmd = prepare["command"]
    assert cmd[cmd.index("--engine-cache") + 1] == f"{ARTIFACT_MOUNT}/x.engine-k"
    assert cmd[cmd.index("--engine-cache-dir") + 1] == ENGINE_CACHE_DIR
    assert json.loads(cmd[cmd.index("--engine-config") + 1]) == CONFIG
    assert "--engine-hardware" not in cmd
    assert {"name": "modelstage-engine-cache", "emptyDir": {}} in pod["volumes"]
    mount = {"name": "modelstage-engine-cache", "mountPath": ENGINE_CACHE_DIR}
    assert mount in prepare["volumeMounts"] and mount in container(workload)["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container(workload)["env"]}
    for name, var in ROOTS.items():
        assert env[var] == f"{ENGINE_CACHE_DIR}/{name}"
    assert env["VLLM_USE_AOT_COMPILE"] == "0"
    assert plan_rollout(spec, art(spec), workload, engine_cache=use()).merge_patch == {}


def test_a_roll_without_the_cache_takes_every_part_of_it_away(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    without = rolled(spec, rolled(spec, deployment, use()), None)
    assert without == rolled(spec, deployment, None)
    assert ENGINE_CACHE_ANNOTATION not in without["spec"]["template"]["metadata"]["annotations"]


def test_a_gpu_cache_names_its_class_and_the_users_own_setting_is_kept(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec)
    workload = rolled(
        spec, _with_env(deployment, "VLLM_USE_AOT_COMPILE", "1"), use(json.dumps(GPU))
    )
    cmd = workload["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert json.loads(cmd[cmd.index("--engine-hardware") + 1]) == GPU
    env = [e for e in container(workload)["env"] if e["name"] == "VLLM_USE_AOT_COMPILE"]
    assert env == [{"name": "VLLM_USE_AOT_COMPILE", "value": "1"}]


def test_the_ready_url_is_the_containers_http_readiness_probe(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 4})
    env = {e["name"]: e.get("value") for e in container(rolled(spec, deployment, None))["env"]}
    assert env["MODELSTAGE_READY_URL"] == "http://127.0.0.1:8000/health"  # port "http" by name
    exec_probe = copy.deepcopy(deployment)
    container(exec_probe)["readinessProbe"] = {"exec": {"command": ["true"]}}
    env = {e["name"] for e in container(rolled(spec, exec_probe, None))["env"]}
    assert "MODELSTAGE_READY_URL" not in env


def test_engine_cache_defaults_are_off() -> None:
    assert EngineCache().enabled is False and EngineCache().deadline_seconds == 1800


def test_deleting_a_failed_capture_job_captures_again_with_a_new_deadline(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = enabled(make_spec, deadlineSeconds=600)
    failed = step_for(spec, deployment, job=JobObservation("Failed", "error: oom"))
    later = T0 + timedelta(hours=2)
    again = step_for(spec, deployment, before=failed.status, now=later)
    assert again.create is not None and not again.roll
    assert again.status.phase == "Capturing" and again.status.since == later


def test_the_capture_runs_vllm_at_the_artifacts_layer_partition(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    """vLLM compiles each stage's layers: the capture builds the stages the pods will."""
    spec = make_spec(parallelism={"tensor": 2, "pipeline": 2, "layerPartition": [5, 3]},
                     engineCache={"enabled": True})  # fmt: skip
    job = plan_capture_job(spec, art(spec), inputs_of(spec, deployment), owner=OWNER)
    (capture,) = job["spec"]["template"]["spec"]["containers"]
    assert {"name": "VLLM_PP_LAYER_PARTITION", "value": "5,3"} in capture["env"]


def test_an_s3_artifacts_capture_reads_and_writes_the_bucket_as_the_stager_does(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    """No claim: the artifact and the cache are S3 prefixes, reached with the connection's
    flags, its endpoint and credentials by Secret reference and its CA bundle mounted."""
    s3 = {"uri": "s3://bucket/p", "endpoint": "https://s3.local:9000", "region": "eu-1",
          "credentialsSecret": "s3-creds", "caBundleSecret": "s3-ca"}  # fmt: skip
    spec = make_spec(loadFormat="runai_streamer_sharded", storage={"pvc": None, "s3": s3},
                     engineCache={"enabled": True})  # fmt: skip
    a = art(spec)
    inputs = inputs_of(spec, deployment)
    job = plan_capture_job(spec, a, inputs, owner=OWNER)
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    pod = job["spec"]["template"]["spec"]
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
    assert {"name": "modelstage-s3-ca", "secret": {"secretName": "s3-ca", "items": [
        {"key": "ca.crt", "path": "ca.crt"}]}} in pod["volumes"]  # fmt: skip
    (install,) = pod["initContainers"]
    (capture,) = pod["containers"]
    out = f"{a.location.path}.engine-{inputs.key(a.digest)}"
    assert out.startswith("s3://bucket/p/")
    command = capture["command"]
    assert command[command.index("--artifact") + 1] == a.location.path
    assert command[command.index("--out") + 1] == out
    for container in (install, capture):
        flags = container["command"]
        assert "--s3-endpoint=https://s3.local:9000" in flags and "--s3-path-style" in flags
        env = {e["name"]: e for e in container["env"]}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
        assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
        assert {"name": "modelstage-s3-ca", "mountPath": "/etc/modelstage/s3-ca",
                "readOnly": True} in container["volumeMounts"]  # fmt: skip
