"""Checks beyond the schema: findings with actionable messages, never exceptions."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from modelstage.api.modeldeployment import ModelDeploymentSpec
from modelstage.operator.validation import (
    Finding,
    findings_condition,
    validate_spec,
    validate_workload,
)

SpecFactory = Callable[..., ModelDeploymentSpec]
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def check(
    spec: ModelDeploymentSpec, workload: dict[str, Any] | None, claim: dict[str, Any] | None = None
) -> list[Finding]:
    return validate_workload(
        spec, workload, namespace="llm", deployment_name="llama-70b", claim=claim
    )


def reasons(findings: list[Finding]) -> list[str]:
    return [f.reason for f in findings]


def claim(*modes: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "models"},
        "spec": {"accessModes": list(modes)},
        "status": {"accessModes": list(modes)},
    }


def test_the_example_workload_is_fine(make_spec: SpecFactory, deployment: dict[str, Any]) -> None:
    assert check(make_spec(parallelism={"tensor": 4}), deployment, claim("ReadWriteMany")) == []


def test_a_workload_without_the_opt_in_is_refused_and_not_inspected(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    del deployment["metadata"]["annotations"]
    deployment["spec"]["template"]["spec"]["containers"] = []  # not read: no ContainerNotFound
    (finding,) = check(make_spec(), deployment)
    assert (finding.reason, finding.blocks) == ("TargetNotOptedIn", "rollout")
    assert "Deployment vllm-llama has not opted in" in finding.message
    assert "modelstage.io/model-deployment: llama-70b" in finding.message


def test_a_workload_that_opted_in_for_another_model_deployment_is_refused(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    deployment["metadata"]["annotations"]["modelstage.io/model-deployment"] = "mistral"
    (finding,) = check(make_spec(), deployment)
    assert finding.reason == "TargetNotOptedIn"
    assert "opted in for ModelDeployment 'mistral', not 'llama-70b'" in finding.message


def test_a_non_vllm_workload_of_the_namespace_cannot_be_taken_over(
    make_spec: SpecFactory,
) -> None:
    payments = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "payments-api", "namespace": "llm"},
        "spec": {"template": {"spec": {"containers": [
            {"name": "api", "image": "example/payments:1", "args": ["--port", "8080"]},
        ]}}},
    }  # fmt: skip
    spec = make_spec(serving={"targetRef": {"name": "payments-api"}, "containerName": None})
    assert reasons(check(spec, payments)) == ["TargetNotOptedIn"]
    payments["metadata"]["annotations"] = {"modelstage.io/model-deployment": "llama-70b"}
    assert reasons(check(spec, payments)) == ["VllmCommandNotRecognized"]


DEFAULT_IMAGE = "ghcr.io/modelstage/stager:0.1.0"
IMAGES = (
    DEFAULT_IMAGE,
    "registry.local/modelstage/stager",
    "registry.local/pinned@sha256:" + "c" * 64,
)


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("ghcr.io/modelstage/stager:0.1.0", True),
        ("ghcr.io/modelstage/stager:0.1.0@sha256:" + "0" * 64, False),
        ("registry.local/modelstage/stager:0.2.0@sha256:" + "b" * 64, True),
        ("registry.local/pinned@sha256:" + "c" * 64, True),
        ("registry.local/pinned@sha256:" + "d" * 64, False),
        ("registry.local/pinned:1.0@sha256:" + "c" * 64, False),
        ("registry.local/pinned", False),
        ("registry.local/modelstage/stager:0.2.0", True),
        ("registry.local/modelstage/stager@sha256:" + "a" * 64, True),
        ("attacker/img:latest", False),
        ("ghcr.io/modelstage/stager:latest", False),
        ("ghcr.io/modelstage/stager", False),
        ("registry.local/modelstage/stager-evil:1", False),
        ("registry.local/modelstage/stager/evil:1", False),
        ("registry.local/modelstage/stager:1/../evil", False),
        ("registry.local/modelstage/stager@sha256:short", False),
    ],
)
def test_a_stager_image_must_be_one_the_operator_allows(
    make_spec: SpecFactory, image: str, allowed: bool
) -> None:
    findings = validate_spec(make_spec(stager={"image": image}), allowed_images=IMAGES)
    if allowed:
        assert findings == []
        return
    (finding,) = findings
    assert (finding.reason, finding.blocks) == ("StagerImageNotAllowed", "staging")
    assert f"spec.stager.image {image!r} is not one of the stager images" in finding.message
    assert (
        "remove spec.stager.image to use the operator's default " + DEFAULT_IMAGE in finding.message
    )


def test_no_stager_image_in_the_spec_takes_the_operators_default(make_spec: SpecFactory) -> None:
    assert validate_spec(make_spec(), allowed_images=IMAGES) == []
    assert reasons(validate_spec(make_spec(stager={"image": DEFAULT_IMAGE}))) == [
        "StagerImageNotAllowed"
    ]  # nothing is allowed unless the operator says so


def test_unknown_vllm_version_blocks_staging(make_spec: SpecFactory) -> None:
    (finding,) = validate_spec(make_spec(serving={"vllmVersion": "0.9"}))
    assert finding.reason == "UnsupportedVllmVersion"
    assert finding.blocks == "staging"
    assert "supported: 0.28, " in finding.message and finding.message.endswith("0.32")


def test_known_vllm_patch_release_is_fine(make_spec: SpecFactory) -> None:
    assert validate_spec(make_spec(serving={"vllmVersion": "0.32.9"})) == []


def test_missing_workload_blocks_only_the_rollout(make_spec: SpecFactory) -> None:
    (finding,) = check(make_spec(), None)
    assert finding.reason == "TargetNotFound" and finding.blocks == "rollout"
    assert "Deployment vllm-llama not found in namespace llm" in finding.message
    assert "spec.serving.targetRef" in finding.message


def test_missing_container_names_the_ones_that_exist(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    (finding,) = check(make_spec(serving={"containerName": "server"}), deployment)
    assert finding.reason == "ContainerNotFound"
    assert (
        "vllm, metrics-proxy" in finding.message and "spec.serving.containerName" in finding.message
    )


def test_several_containers_without_a_name_ask_for_one(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    (finding,) = check(make_spec(serving={"containerName": None}), deployment)
    assert (
        finding.reason == "ContainerNotFound"
        and "set spec.serving.containerName" in finding.message
    )


def test_tp_above_the_gpus_the_container_requests(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    (finding,) = check(make_spec(parallelism={"tensor": 8}), deployment, claim("ReadWriteMany"))
    assert finding.reason == "InsufficientGPUs" and finding.blocks == "rollout"
    assert "tensor is 8" in finding.message and "requests 4 nvidia.com/gpu" in finding.message
    assert "'nvidia.com/gpu'] to 8" in finding.message


def test_gpu_requests_count_when_limits_are_absent(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"requests": {"amd.com/gpu": "2"}}
    assert reasons(check(make_spec(parallelism={"tensor": 4}), deployment)) == ["InsufficientGPUs"]


def test_a_cpu_only_workload_is_not_judged_by_gpus(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    deployment["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "8"}}
    assert check(make_spec(parallelism={"tensor": 4}), deployment) == []


def test_shell_wrapped_vllm_is_reported(make_spec: SpecFactory, deployment: dict[str, Any]) -> None:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["command"], container["args"] = ["/bin/sh", "-c"], ["vllm serve m --port 8000"]
    assert reasons(check(make_spec(parallelism={"tensor": 4}), deployment)) == [
        "VllmCommandNotRecognized"
    ]


def test_read_write_once_with_replicas_on_several_nodes_warns(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    (finding,) = check(make_spec(parallelism={"tensor": 4}), deployment, claim("ReadWriteOnce"))
    assert finding.reason == "ReadWriteOnceMultiNode" and finding.blocks == "nothing"
    assert "PVC models is ReadWriteOnce" in finding.message and "2 replicas" in finding.message
    assert "ReadWriteMany" in finding.message


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["spec"].update(replicas=1),
        lambda d: d["spec"]["template"]["spec"].update(
            nodeSelector={"kubernetes.io/hostname": "gpu-1"}
        ),
    ],
    ids=["one-replica", "pinned-to-a-node"],
)
def test_read_write_once_is_fine_on_one_node(
    make_spec: SpecFactory, deployment: dict[str, Any], change: Callable[[dict[str, Any]], None]
) -> None:
    change(deployment)
    assert check(make_spec(parallelism={"tensor": 4}), deployment, claim("ReadWriteOnce")) == []


def test_claim_to_create_is_judged_by_its_template(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(
        parallelism={"tensor": 4},
        storage={
            "pvc": {
                "claimName": None,
                "create": {"size": "100Gi", "accessModes": ["ReadWriteOnce"]},
            }
        },
    )
    (finding,) = check(spec, deployment)
    assert "PVC modelstage-llama-70b is ReadWriteOnce" in finding.message


def test_read_write_once_pod_blocks_the_rollout(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    (finding,) = check(make_spec(parallelism={"tensor": 4}), deployment, claim("ReadWriteOncePod"))
    assert finding.reason == "AccessModeTooNarrow" and finding.blocks == "rollout"


def test_s3_storage_has_no_access_mode_concerns(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(
        parallelism={"tensor": 4},
        loadFormat="tensorizer",
        storage={"pvc": None, "s3": {"uri": "s3://bkt/p"}},
    )
    assert check(spec, deployment) == []


def test_findings_become_one_degraded_condition(make_spec: SpecFactory) -> None:
    findings = check(make_spec(), None) + validate_spec(make_spec(serving={"vllmVersion": "0.1"}))
    cond = findings_condition(findings, now=NOW, generation=3)
    assert (cond.type, cond.status, cond.reason, cond.observed_generation) == (
        "Degraded",
        "True",
        "TargetNotFound",
        3,
    )
    assert all(f.message in cond.message for f in findings)
    ok = findings_condition([], now=NOW)
    assert (ok.status, ok.reason) == ("False", "AsExpected")


def test_gpus_count_every_stage_of_the_pipeline(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 2, "pipeline": 4})
    (finding,) = check(spec, deployment, claim("ReadWriteMany"))
    assert finding.reason == "InsufficientGPUs"
    assert "pipeline 4" in finding.message and "'nvidia.com/gpu'] to 8" in finding.message
    assert check(make_spec(parallelism={"tensor": 2, "pipeline": 2}), deployment,
                 claim("ReadWriteMany")) == []  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loadFormat": "tensorizer"}, "by its tensor-parallel rank alone"),
        ({"serving": {"vllmVersion": "0.31"}, "loadFormat": "sharded_state"}, "vLLM 0.31's"),
        ({"stager": {"parallelism": 4}}, "scale-out staging"),
    ],
)
def test_what_the_stager_refuses_at_a_pipeline_size_is_said_before_any_job(
    make_spec: SpecFactory, overrides: dict[str, Any], message: str
) -> None:
    spec = make_spec(parallelism={"tensor": 2, "pipeline": 2}, **overrides)
    findings = [f for f in validate_spec(spec) if f.reason == "PipelineNotSupported"]
    assert len(findings) == 1 and message in findings[0].message
    assert findings[0].blocks == "staging"
    assert not [f for f in validate_spec(make_spec(**overrides))
                if f.reason == "PipelineNotSupported"]  # fmt: skip
