"""``spec + artifact + workload -> merge patch``: the serving-side contract
(docs/architecture.md) lands in the pod template, nothing the operator does not own changes, and planning
against the patched workload gives an empty patch."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modelstage.api.modeldeployment import ArtifactStatus, ModelDeploymentSpec
from modelstage.core.errors import SpecError
from modelstage.operator.artifact import (
    ARTIFACT_MOUNT,
    Artifact,
    artifact_for,
    artifact_from_status,
)
from modelstage.operator.patch import apply_merge_patch
from modelstage.operator.rollout_plan import plan_rollout

IDENTITY = "commit:" + "ab" * 20
"""A resolved source identity (a Hub commit) for planner tests."""

SpecFactory = Callable[..., ModelDeploymentSpec]
S3 = {
    "pvc": None,
    "s3": {
        "uri": "s3://models/modelstage",
        "endpoint": "http://seaweed.storage:8333",
        "region": "us-east-1",
        "credentialsSecret": "s3-creds",
        "caBundleSecret": "s3-ca",
    },
}


def artifact(spec: ModelDeploymentSpec) -> Artifact:
    return artifact_for(spec, namespace="llm", deployment_name="llama", identity=IDENTITY)


def roll(spec: ModelDeploymentSpec, workload: dict[str, Any]) -> dict[str, Any]:
    """The workload after the planned patch."""
    patched: dict[str, Any] = apply_merge_patch(
        workload, plan_rollout(spec, artifact(spec), workload).merge_patch
    )
    return patched


def pod(workload: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = workload["spec"]["template"]["spec"]
    return result


def vllm(workload: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod(workload)["containers"] if c["name"] == "vllm")


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_vllm_args_point_at_the_artifact(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 4})
    art = artifact(spec)
    container = vllm(roll(spec, deployment))
    assert container["command"] == ["vllm", "serve"]
    assert container["args"] == [
        art.location.path, "--tensor-parallel-size=4", "--max-model-len", "8192",
        "--gpu-memory-utilization", "0.92", "--enable-prefix-caching",
        "--load-format", "modelstage_sharded_state",
        "--served-model-name", "meta-llama/Meta-Llama-3-70B-Instruct",
    ]  # fmt: skip
    assert art.location.path.startswith(f"{ARTIFACT_MOUNT}/artifacts/llm/")


def test_serving_contract_env_init_container_and_volumes(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 4}, stager={"image": "registry.local/stager:1"})
    art = artifact(spec)
    rolled = roll(spec, deployment)
    container = vllm(rolled)
    assert env(container) == {
        "HF_TOKEN": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
        "MODELSTAGE_DIGEST": art.digest,
        "MODELSTAGE_FORMAT": "sharded_state",
        "MODELSTAGE_TP": "4",
        "MODELSTAGE_ARTIFACT": art.location.path,
        "MODELSTAGE_READY_URL": "http://127.0.0.1:8000/health",
        "PYTHONPATH": "/opt/modelstage/plugins",
    }
    assert container["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "modelstage-artifacts", "mountPath": ARTIFACT_MOUNT, "readOnly": True},
        {"name": "modelstage-plugins", "mountPath": "/opt/modelstage/plugins", "readOnly": True},
    ]
    assert pod(rolled)["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        {
            "name": "modelstage-artifacts",
            "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
        },
        {"name": "modelstage-plugins", "emptyDir": {}},
        {"name": "modelstage-no-token", "emptyDir": {"sizeLimit": "1Mi"}},
    ]
    (init,) = pod(rolled)["initContainers"]
    assert init["image"] == "registry.local/stager:1"
    assert init["command"] == [
        "modelstage", "prepare", "--artifact", art.location.path, "--digest", art.digest,
        "--tp", "4", "--plugin-dir", "/opt/modelstage/plugins",
    ]  # fmt: skip
    assert {"name": "modelstage-plugins", "mountPath": "/opt/modelstage/plugins"} in init[
        "volumeMounts"
    ]
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    # An empty folder where the service-account token would be: the initContainer gets none.
    assert {"name": "modelstage-no-token", "readOnly": True,
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"} in init["volumeMounts"]  # fmt: skip
    assert all(m["name"] != "modelstage-no-token" for m in container["volumeMounts"])
    annotations = rolled["spec"]["template"]["metadata"]["annotations"]
    assert annotations["modelstage.io/artifact-digest"] == art.digest


def test_other_containers_volumes_and_fields_are_left_alone(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    rolled = roll(make_spec(), deployment)
    sidecar = [c for c in pod(rolled)["containers"] if c["name"] == "metrics-proxy"]
    assert sidecar == [c for c in pod(deployment)["containers"] if c["name"] == "metrics-proxy"]
    assert rolled["spec"]["strategy"] == deployment["spec"]["strategy"]
    assert rolled["metadata"] == deployment["metadata"]
    before, after = vllm(deployment), vllm(rolled)
    for key in ("image", "ports", "readinessProbe", "resources"):
        assert after[key] == before[key]


def test_patch_touches_only_the_pod_template_and_is_a_merge_patch(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec()
    patch = plan_rollout(spec, artifact(spec), deployment).merge_patch
    assert list(patch) == ["spec"] and list(patch["spec"]) == ["template"]
    assert "$patch" not in str(patch) and "$setElementOrder" not in str(patch)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"serving": {"plugin": False}},
        {"loadFormat": "tensorizer", "storage": S3},
        {"loadFormat": "runai_streamer_sharded", "storage": S3},
    ],
    ids=["pvc-plugin", "pvc-stock", "s3-tensorizer", "s3-runai"],
)
def test_planning_against_the_patched_workload_changes_nothing(
    make_spec: SpecFactory, deployment: dict[str, Any], overrides: dict[str, Any]
) -> None:
    spec = make_spec(**overrides)
    plan = plan_rollout(spec, artifact(spec), deployment)
    once = apply_merge_patch(deployment, plan.merge_patch)
    assert apply_merge_patch(once, plan.merge_patch) == once
    again = plan_rollout(spec, artifact(spec), once)
    assert again.merge_patch == {} and not again.changed
    assert again.template == once["spec"]["template"]


def test_plan_carries_the_resource_version_for_a_conditional_write(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec()
    plan = plan_rollout(spec, artifact(spec), deployment)
    assert plan.resource_version == "1001"
    assert plan.details and artifact(spec).digest in plan.details[0]


def test_stock_loaders_without_the_plugin(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    rolled = roll(make_spec(serving={"plugin": False}), deployment)
    container = vllm(rolled)
    assert container["args"][container["args"].index("--load-format") + 1] == "sharded_state"
    assert "initContainers" not in pod(rolled)
    assert "PYTHONPATH" not in env(container)
    assert all(v["name"] != "modelstage-plugins" for v in pod(rolled)["volumes"])


def test_turning_the_plugin_off_removes_what_it_added_and_keeps_the_users_pythonpath(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    vllm(deployment)["env"].append({"name": "PYTHONPATH", "value": "/app/lib"})
    with_plugin = roll(make_spec(), deployment)
    assert env(vllm(with_plugin))["PYTHONPATH"] == "/opt/modelstage/plugins:/app/lib"
    without = roll(make_spec(serving={"plugin": False}), with_plugin)
    assert env(vllm(without))["PYTHONPATH"] == "/app/lib"
    assert "initContainers" not in pod(without)
    assert [v["name"] for v in pod(without)["volumes"]] == ["dshm", "modelstage-artifacts"]


def test_users_own_init_containers_stay_first(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    pod(deployment)["initContainers"] = [
        {"name": "warmup", "image": "busybox", "command": ["true"]}
    ]
    names = [c["name"] for c in pod(roll(make_spec(), deployment))["initContainers"]]
    assert names == ["warmup", "modelstage-prepare"]


def test_s3_artifact_gets_the_s3_env_by_reference(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(loadFormat="runai_streamer_sharded", storage=S3)
    art = artifact(spec)
    rolled = roll(spec, deployment)
    container = vllm(rolled)
    assert container["args"][0] == art.location.path == f"s3://models/modelstage/llm/{art.digest}"
    got = env(container)
    assert (
        got["AWS_ENDPOINT_URL"]
        == got["RUNAI_STREAMER_S3_ENDPOINT"]
        == "http://seaweed.storage:8333"
    )
    assert got["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] == "0"
    assert got["AWS_REGION"] == "us-east-1"
    assert got["AWS_CA_BUNDLE"] == "/etc/modelstage/s3-ca/ca.crt"
    assert got["AWS_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert got["AWS_SECRET_ACCESS_KEY"] == {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}
    }
    assert all(v["name"] != "modelstage-artifacts" for v in pod(rolled)["volumes"])
    (init,) = pod(rolled)["initContainers"]
    assert env(init)["AWS_ENDPOINT_URL"] == "http://seaweed.storage:8333"
    assert {
        "name": "modelstage-s3-ca",
        "mountPath": "/etc/modelstage/s3-ca",
        "readOnly": True,
    } in init["volumeMounts"]


def test_virtual_addressing_leaves_the_streamer_default(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    storage = {"pvc": None, "s3": {"uri": "s3://models/p", "virtualAddressing": True}}
    container = vllm(roll(make_spec(loadFormat="runai_streamer", storage=storage), deployment))
    assert "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING" not in env(container)


@pytest.mark.parametrize("load_format", ["runai_streamer", "runai_streamer_sharded"])
def test_s3_artifacts_get_stock_load_format_names_even_with_the_plugin(
    make_spec: SpecFactory, deployment: dict[str, Any], load_format: str
) -> None:
    """vLLM refuses ``--model s3://`` unless the load format is one of its Run:ai names."""
    storage = {"pvc": None, "s3": {"uri": "s3://models/p"}}
    spec = make_spec(loadFormat=load_format, storage=storage)
    assert spec.serving.plugin
    container = vllm(roll(spec, deployment))
    assert container["args"][container["args"].index("--load-format") + 1] == load_format
    init = pod(roll(spec, deployment))["initContainers"]
    assert any(c["name"] == "modelstage-prepare" for c in init)


def test_the_plugin_reads_per_rank_s3_artifacts_itself_until_it_is_turned_off(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    """``MODELSTAGE_S3_READER`` hands vLLM's ``runai_streamer_sharded`` name to the plugin's
    reader; the Hugging Face layout stays with Run:ai, and turning the plugin off drops it."""
    storage = {"pvc": None, "s3": {"uri": "s3://models/p"}}
    sharded = roll(make_spec(loadFormat="runai_streamer_sharded", storage=storage), deployment)
    assert env(vllm(sharded))["MODELSTAGE_S3_READER"] == "1"
    plain = roll(make_spec(loadFormat="runai_streamer", storage=storage), deployment)
    assert "MODELSTAGE_S3_READER" not in env(vllm(plain))
    off = make_spec(loadFormat="runai_streamer_sharded", storage=storage,
                    serving={"plugin": False})  # fmt: skip
    assert "MODELSTAGE_S3_READER" not in env(vllm(roll(off, sharded)))
    on_pvc = roll(make_spec(loadFormat="sharded_state"), sharded)
    assert "MODELSTAGE_S3_READER" not in env(vllm(on_pvc))


@pytest.mark.parametrize(("load_format", "kept"), [
    ("runai_streamer", {"concurrency": 16}),
    ("runai_streamer_sharded", None),  # vLLM's ShardedStateLoader refuses any key but pattern
])  # fmt: skip
def test_users_runai_extra_config_is_kept_only_where_vllm_accepts_it(
    make_spec: SpecFactory, deployment: dict[str, Any], load_format: str, kept: Any
) -> None:
    vllm(deployment)["args"] += ["--model-loader-extra-config", '{"concurrency": 16}']
    storage = {"pvc": None, "s3": {"uri": "s3://models/p"}}
    args = vllm(roll(make_spec(loadFormat=load_format, storage=storage), deployment))["args"]
    flag = "--model-loader-extra-config"
    got = json.loads(args[args.index(flag) + 1]) if flag in args else None
    assert got == kept


def test_tensorizer_gets_the_per_rank_uri_and_its_own_s3_variables(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(loadFormat="tensorizer", storage=S3)
    art = artifact(spec)
    container = vllm(roll(spec, deployment))
    args = container["args"]
    assert args[args.index("--load-format") + 1] == "tensorizer"
    assert args[args.index("--model-loader-extra-config") + 1] == (
        '{"tensorizer_uri":"' + art.location.path + '/model-rank-%03d.tensors"}'
    )
    got = env(container)
    assert got["S3_ENDPOINT_URL"] == "http://seaweed.storage:8333"
    assert got["S3_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    }
    # what tensorizer itself uses: AWS_ENDPOINT_URL, boto3's AWS_*, curl's CA bundle
    assert got["AWS_ENDPOINT_URL"] == "http://seaweed.storage:8333"
    assert got["CURL_CA_BUNDLE"] == got["AWS_CA_BUNDLE"]
    assert got["S3_SECRET_ACCESS_KEY"] == {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}
    }
    runai = env(vllm(roll(make_spec(loadFormat="runai_streamer", storage=S3), deployment)))
    assert "AWS_CA_BUNDLE" in runai and not {"CURL_CA_BUNDLE", "S3_ENDPOINT_URL"} & set(runai)


def test_moving_from_s3_to_a_pvc_drops_the_s3_env_but_not_the_users(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    vllm(deployment)["env"].append({"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"})
    on_s3 = roll(make_spec(loadFormat="tensorizer", storage=S3), deployment)
    on_pvc = roll(make_spec(loadFormat="tensorizer"), on_s3)
    names = set(env(vllm(on_pvc)))
    assert not names & {
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "S3_ENDPOINT_URL",
        "AWS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
    }
    assert {"HF_TOKEN", "VLLM_LOGGING_LEVEL", "MODELSTAGE_DIGEST"} <= names
    assert all(v["name"] != "modelstage-s3-ca" for v in pod(on_pvc)["volumes"])


def test_rolling_back_uses_the_old_artifacts_format_and_tp(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 4})
    rolled = roll(spec, deployment)
    old = ArtifactStatus(
        digest="00000000000000000000", uri="pvc://models/artifacts/llm/00000000000000000000",
        format="tensorizer", tensor_parallel_size=2,
    )  # fmt: skip
    back = apply_merge_patch(
        rolled, plan_rollout(spec, artifact_from_status(old), rolled).merge_patch
    )
    args = vllm(back)["args"]
    assert args[0] == f"{ARTIFACT_MOUNT}/artifacts/llm/00000000000000000000"
    assert args[args.index("--tensor-parallel-size=2")] == "--tensor-parallel-size=2"
    assert args[args.index("--load-format") + 1] == "tensorizer"
    assert args.count("--served-model-name") == 1
    assert (
        back["spec"]["template"]["metadata"]["annotations"]["modelstage.io/artifact-digest"]
        == old.digest
    )


def test_statefulsets_are_patched_the_same_way(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    statefulset = copy.deepcopy(deployment)
    statefulset.update(kind="StatefulSet")
    statefulset["spec"].pop("strategy")
    statefulset["spec"]["serviceName"] = "vllm"
    spec = make_spec(serving={"targetRef": {"kind": "StatefulSet"}})
    assert roll(spec, statefulset)["spec"]["template"] == roll(spec, deployment)["spec"]["template"]


def test_single_container_pods_need_no_container_name(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    pod(deployment)["containers"] = [vllm(deployment)]
    spec = make_spec(serving={"containerName": None})
    assert vllm(roll(spec, deployment))["args"][0] == artifact(spec).location.path


def test_unknown_container_is_a_spec_error_listing_the_containers(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(serving={"containerName": "server"})
    with pytest.raises(SpecError, match="containers: vllm, metrics-proxy"):
        plan_rollout(spec, artifact(spec), deployment)


@pytest.mark.parametrize(
    "overrides", [{}, {"loadFormat": "runai_streamer", "storage": S3}], ids=["pvc", "s3"]
)
def test_patched_deployment_passes_kubernetes_schema(
    make_spec: SpecFactory, deployment: dict[str, Any], overrides: dict[str, Any]
) -> None:
    rolled = roll(make_spec(**overrides), deployment)
    kubernetes_validate.validate(rolled, kubernetes_validate.latest_version(), strict=True)


VARIANTS = st.fixed_dictionaries(
    {
        "loadFormat": st.sampled_from(
            ["sharded_state", "runai_streamer", "runai_streamer_sharded", "tensorizer"]
        ),
        "plugin": st.booleans(),
        "tp": st.sampled_from([1, 2, 4, 8]),
        "s3": st.booleans(),
    }
)


def variant_spec(make_spec: SpecFactory, v: dict[str, Any]) -> ModelDeploymentSpec:
    fmt = v["loadFormat"]
    on_s3 = fmt.startswith("runai") or (fmt == "tensorizer" and v["s3"])
    return make_spec(
        loadFormat=fmt,
        parallelism={"tensor": v["tp"]},
        serving={"plugin": v["plugin"]},
        storage=S3 if on_s3 else {},
    )


@settings(
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(history=st.lists(VARIANTS, min_size=1, max_size=4))
def test_any_sequence_of_rollouts_ends_stable_and_keeps_the_users_items(
    make_spec: SpecFactory, deployment: dict[str, Any], history: list[dict[str, Any]]
) -> None:
    workload = copy.deepcopy(deployment)
    for v in history:
        workload = roll(variant_spec(make_spec, v), workload)
    last = variant_spec(make_spec, history[-1])
    assert plan_rollout(last, artifact(last), workload).merge_patch == {}
    container = vllm(workload)
    args = container["args"]
    for token in ("--max-model-len", "8192", "--enable-prefix-caching", "--gpu-memory-utilization"):
        assert args.count(token) == 1
    assert args.count("--served-model-name") == 1
    assert args[args.index("--served-model-name") + 1] == "meta-llama/Meta-Llama-3-70B-Instruct"
    assert env(container)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    assert pod(workload)["volumes"][0]["name"] == "dshm"
    assert [c["name"] for c in pod(workload)["containers"]] == ["vllm", "metrics-proxy"]


def test_a_pipelined_artifact_sets_vllms_pipeline_size_and_prepare_checks_it(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 2, "pipeline": 2})
    art = artifact(spec)
    assert art.pp == 2
    rolled = roll(spec, deployment)
    args = vllm(rolled)["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    (init,) = pod(rolled)["initContainers"]
    assert init["command"][init["command"].index("--pp") + 1] == "2"
    again = plan_rollout(spec, art, rolled).merge_patch
    assert apply_merge_patch(rolled, again) == rolled, "planning again changes nothing"


def test_rolling_back_from_a_pipeline_restores_the_old_artifacts_pipeline_size(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 2, "pipeline": 2})
    rolled = roll(spec, deployment)
    old = ArtifactStatus(
        digest="00000000000000000000", uri="pvc://models/artifacts/llm/00000000000000000000",
        format="sharded_state", tensor_parallel_size=2,
    )  # fmt: skip  (recorded before pipelineParallelSize: PP 1)
    back = apply_merge_patch(
        rolled, plan_rollout(spec, artifact_from_status(old), rolled).merge_patch
    )
    args = vllm(back)["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "1"
    (init,) = pod(back)["initContainers"]
    assert "--pp" not in init["command"]


def test_a_layer_partition_is_set_for_vllm_and_taken_back_for_an_artifact_without_one(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 2, "pipeline": 2, "layerPartition": [5, 3]})
    assert artifact(spec).pp_partition == (5, 3)
    rolled = roll(spec, deployment)
    assert env(vllm(rolled))["VLLM_PP_LAYER_PARTITION"] == "5,3"
    even = make_spec(parallelism={"tensor": 2, "pipeline": 2})
    back = roll(even, rolled)
    assert "VLLM_PP_LAYER_PARTITION" not in env(vllm(back)), "the operator's value, removed"


def test_rolling_back_restores_the_old_artifacts_layer_partition(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(parallelism={"tensor": 2, "pipeline": 2})
    rolled = roll(spec, deployment)
    old = ArtifactStatus(
        digest="00000000000000000000", uri="pvc://models/artifacts/llm/00000000000000000000",
        format="sharded_state", tensor_parallel_size=2, pipeline_parallel_size=2,
        layer_partition=(6, 2),
    )  # fmt: skip
    back = apply_merge_patch(
        rolled, plan_rollout(spec, artifact_from_status(old), rolled).merge_patch
    )
    assert env(vllm(back))["VLLM_PP_LAYER_PARTITION"] == "6,2"


def test_a_workloads_own_layer_partition_is_left_alone_without_one_in_the_spec(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    """Not the operator's to remove: the plugin refuses the start when it differs from the
    artifact's (tests/plugin), which names spec.parallelism.layerPartition as the fix."""
    workload = copy.deepcopy(deployment)
    vllm(workload).setdefault("env", []).append({"name": "VLLM_PP_LAYER_PARTITION", "value": "7,1"})
    rolled = roll(make_spec(parallelism={"tensor": 2, "pipeline": 2}), workload)
    assert env(vllm(rolled))["VLLM_PP_LAYER_PARTITION"] == "7,1"
