"""``spec + artifact -> stager Job``: deterministic, the stager CLI contract, Secrets by reference,
restricted security, PVC or S3 wiring, and a manifest Kubernetes' own schema accepts."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kubernetes_validate
import pytest
from modelstage.api.modeldeployment import ModelDeploymentSpec
from modelstage.api.objects import Owner
from modelstage.operator.artifact import ARTIFACT_MOUNT, artifact_at, spec_digest
from modelstage.operator.job_plan import (
    StagingStep,
    finalize_job_name,
    plan_stage_job,
    stage_job_name,
    staging_jobs,
    staging_step,
)

IDENTITY = "commit:" + "ab" * 20
"""A resolved source identity (a Hub commit) for planner tests."""

SpecFactory = Callable[..., ModelDeploymentSpec]
OWNER = Owner(name="llama", namespace="llm", uid="5f1c0000-0000-4000-8000-000000000001")
S3_STORAGE = {
    "pvc": None,
    "s3": {
        "uri": "s3://models/modelstage",
        "endpoint": "https://minio.storage:9000",
        "region": "eu-west-1",
        "credentialsSecret": "s3-creds",
        "caBundleSecret": "minio-ca",
    },
}


def plan(spec: ModelDeploymentSpec, owner: Owner = OWNER) -> dict[str, Any]:
    return plan_stage_job(spec, owner=owner, artifact=artifact_at(spec, namespace=owner.namespace, deployment_name=owner.name, digest=spec_digest(spec, IDENTITY)))


def container(job: dict[str, Any]) -> dict[str, Any]:
    containers = job["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def env(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(job)["env"]}


@pytest.mark.parametrize("length", [63, 64, 100, 253])
def test_every_label_value_fits_the_api_servers_63_characters(
    make_spec: SpecFactory, length: int
) -> None:
    """Object names may have 253 characters; label values 63 (the API server answers 422)."""
    name = ("llama-" + "x" * 300)[: length - 1] + "1"
    job = plan(make_spec(), Owner(name=name, namespace="llm", uid="u"))
    template_labels = job["spec"]["template"]["metadata"]["labels"]
    for labels in (job["metadata"]["labels"], template_labels):
        for value in labels.values():
            assert len(value) <= 63 and re.fullmatch(
                r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", value
            )
    owner = job["metadata"]["labels"]["modelstage.io/model-deployment"]
    assert owner == name if length <= 63 else owner != name
    other = plan(make_spec(), Owner(name=name[:-1] + "2", namespace="llm", uid="u"))
    assert other["metadata"]["labels"]["modelstage.io/model-deployment"] != owner


def test_job_is_named_from_the_digest_and_fits_a_label(make_spec: SpecFactory) -> None:
    spec = make_spec()
    job = plan(spec)
    assert job["metadata"]["name"] == stage_job_name(spec_digest(spec, IDENTITY))
    assert len(job["metadata"]["name"]) <= 63
    other_owner = Owner(name="llama-copy", namespace="llm", uid="another")
    assert plan(spec, other_owner)["metadata"]["name"] == job["metadata"]["name"]


def test_planning_twice_gives_the_same_manifest(make_spec: SpecFactory) -> None:
    assert plan(make_spec()) == plan(make_spec())


def test_hf_source_to_pvc_runs_the_stager_cli_as_contracted(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": "main"}, dtype="bfloat16")
    digest = spec_digest(spec, IDENTITY)
    assert container(plan(spec))["command"] == [
        "modelstage", "stage", "hf://meta-llama/Meta-Llama-3-8B-Instruct",
        "--tp", "2", "--pp", "1", "--dtype", "bfloat16", "--format", "sharded_state",
        "--vllm-version", "0.32", "--digest", digest,
        "--out", f"{ARTIFACT_MOUNT}/artifacts/llm/{digest}",
        "--revision=main",
    ]  # fmt: skip


def test_the_stage_command_reads_tp_and_format_from_the_artifact(make_spec: SpecFactory) -> None:
    """After the digest, the Job's ``--tp`` and ``--format`` are the artifact's, not the spec's
    read again: one value from the digest to the stager."""
    spec = make_spec()
    staged = artifact_at(spec, namespace=OWNER.namespace, deployment_name=OWNER.name,
                         digest=spec_digest(spec, IDENTITY))  # fmt: skip
    other = dataclasses.replace(staged, tp=8, load_format="runai_streamer_sharded")
    command = container(plan_stage_job(spec, owner=OWNER, artifact=other))["command"]
    assert command[command.index("--tp") + 1] == "8"
    assert command[command.index("--format") + 1] == "runai_streamer_sharded"


def test_revision_is_passed_only_when_set(make_spec: SpecFactory) -> None:
    assert not [a for a in container(plan(make_spec()))["command"] if "--revision" in a]


def test_hf_token_comes_from_the_secret_by_reference(make_spec: SpecFactory) -> None:
    token = env(plan(make_spec()))["HF_TOKEN"]
    assert token == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
    }


def test_no_credential_is_ever_a_literal_value(make_spec: SpecFactory) -> None:
    spec = make_spec(loadFormat="tensorizer", storage=S3_STORAGE)
    for name, entry in env(plan(spec)).items():
        if any(word in name for word in ("TOKEN", "KEY", "SECRET")):
            assert "value" not in entry and "secretKeyRef" in entry["valueFrom"], name


def test_artifact_pvc_is_mounted_read_write_at_the_artifact_mount(make_spec: SpecFactory) -> None:
    job = plan(make_spec())
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["modelstage-artifacts"]["persistentVolumeClaim"] == {"claimName": "models"}
    mounts = {m["name"]: m for m in container(job)["volumeMounts"]}
    assert mounts["modelstage-artifacts"] == {
        "name": "modelstage-artifacts",
        "mountPath": ARTIFACT_MOUNT,
    }


def test_pvc_source_is_mounted_read_only_and_named_by_source_uri(make_spec: SpecFactory) -> None:
    spec = make_spec(
        model={"uri": "pvc://checkpoints/meta-llama/Llama-3-8B", "credentialsSecret": None}
    )
    job = plan(spec)
    command = container(job)["command"]
    assert command[2] == "/mnt/modelstage/source/meta-llama/Llama-3-8B"
    assert "--source-uri=pvc://checkpoints/meta-llama/Llama-3-8B" in command
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["modelstage-source"]["persistentVolumeClaim"] == {
        "claimName": "checkpoints",
        "readOnly": True,
    }
    mounts = {m["name"]: m for m in container(job)["volumeMounts"]}
    assert mounts["modelstage-source"]["readOnly"] is True


def test_s3_storage_passes_connection_flags_ca_and_credentials(make_spec: SpecFactory) -> None:
    spec = make_spec(loadFormat="tensorizer", storage=S3_STORAGE)
    job = plan(spec)
    command = container(job)["command"]
    digest = spec_digest(spec, IDENTITY)
    assert command[command.index("--out") + 1] == f"s3://models/modelstage/llm/{digest}"
    assert command[-5:] == [
        "--s3-endpoint=https://minio.storage:9000", "--s3-region=eu-west-1",
        "--s3-path-style", "--s3-ca-bundle", "/etc/modelstage/s3-ca/ca.crt",
    ]  # fmt: skip
    assert env(job)["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds",
        "key": "AWS_ACCESS_KEY_ID",
    }
    assert "HF_TOKEN" in env(job)
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert "modelstage-artifacts" not in volumes
    assert volumes["modelstage-s3-ca"]["secret"]["secretName"] == "minio-ca"


def test_virtual_addressing_drops_the_path_style_flag(make_spec: SpecFactory) -> None:
    storage = {"pvc": None, "s3": {"uri": "s3://models/p", "virtualAddressing": True}}
    command = container(plan(make_spec(loadFormat="tensorizer", storage=storage)))["command"]
    assert "--s3-path-style" not in command and "--s3-endpoint" not in command


def test_s3_source_to_pvc_uses_the_sources_connection(make_spec: SpecFactory) -> None:
    spec = make_spec(
        model={
            "uri": "s3://ckpts/qwen",
            "credentialsSecret": "src-creds",
            "s3": {"endpoint": "http://s3.local"},
        }
    )
    job = plan(spec)
    command = container(job)["command"]
    assert command[2] == "s3://ckpts/qwen"
    assert "--s3-endpoint=http://s3.local" in command
    assert env(job)["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "src-creds"
    assert "HF_TOKEN" not in env(job)


def test_pod_is_restricted_and_reports_through_its_termination_message(
    make_spec: SpecFactory,
) -> None:
    job = plan(make_spec())
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container(job)["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True
    assert container(job)["terminationMessagePolicy"] == "FallbackToLogsOnError"
    scratch = {v["name"]: v for v in pod["volumes"]}["modelstage-scratch"]
    assert set(scratch) == {"name", "emptyDir"} and set(scratch["emptyDir"]) == {"sizeLimit"}


def test_owner_reference_and_labels_tie_the_job_to_its_model_deployment(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec()
    job = plan(spec)
    assert job["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "modelstage.io/v1alpha1",
            "kind": "ModelDeployment",
            "name": "llama",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert job["metadata"]["namespace"] == "llm"
    assert job["metadata"]["labels"]["modelstage.io/digest"] == spec_digest(spec, IDENTITY)
    assert job["spec"]["template"]["metadata"]["labels"] == job["metadata"]["labels"]


def test_stager_options_reach_the_job(make_spec: SpecFactory) -> None:
    spec = make_spec(
        stager={
            "image": "registry.local/stager:dev",
            "resources": {"requests": {"cpu": 4, "memory": "8Gi"}},
            "nodeSelector": {"pool": "staging"},
            "tolerations": [{"key": "staging", "operator": "Exists", "effect": "NoSchedule"}],
            "serviceAccountName": "stager",
            "backoffLimit": 0,
            "activeDeadlineSeconds": 900,
        }
    )
    job = plan(spec)
    pod = job["spec"]["template"]["spec"]
    assert container(job)["image"] == "registry.local/stager:dev"
    assert container(job)["resources"] == {"requests": {"cpu": 4, "memory": "8Gi"}}
    assert pod["nodeSelector"] == {"pool": "staging"}
    assert pod["tolerations"] == [{"key": "staging", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["serviceAccountName"] == "stager"
    assert (job["spec"]["backoffLimit"], job["spec"]["activeDeadlineSeconds"]) == (0, 900)


def test_parallel_staging_is_an_indexed_job_for_per_rank_safetensors(
    make_spec: SpecFactory,
) -> None:
    job = plan(make_spec(stager={"parallelism": 4}))
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    assert env(job)["MODELSTAGE_WORKERS"]["value"] == "4"


def test_tensorizer_has_one_writer_per_rank_file_so_no_scale_out(make_spec: SpecFactory) -> None:
    job = plan(make_spec(loadFormat="tensorizer", stager={"parallelism": 4}))
    assert "completionMode" not in job["spec"]
    assert "MODELSTAGE_WORKERS" not in env(job)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"loadFormat": "tensorizer", "storage": S3_STORAGE},
        {"model": {"uri": "pvc://ckpt/x", "credentialsSecret": None}, "stager": {"parallelism": 2}},
    ],
    ids=["hf-pvc", "hf-s3", "pvc-pvc-indexed"],
)
def test_job_manifest_passes_kubernetes_schema(
    make_spec: SpecFactory, overrides: dict[str, Any]
) -> None:
    kubernetes_validate.validate(
        plan(make_spec(**overrides)), kubernetes_validate.latest_version(), strict=True
    )


# -- scale-out: the Indexed Job, then the finalize Job ------------------------------------------


def jobs(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    return staging_jobs(spec, owner=OWNER, artifact=artifact_at(spec, namespace=OWNER.namespace, deployment_name=OWNER.name, digest=spec_digest(spec, IDENTITY)))


def test_one_pod_staging_is_one_job(make_spec: SpecFactory) -> None:
    assert [j["metadata"]["name"] for j in jobs(make_spec())] == [
        stage_job_name(spec_digest(make_spec(), IDENTITY))
    ]


def test_scaled_out_staging_is_the_indexed_job_then_a_finalize_job_with_its_arguments(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec(stager={"parallelism": 4})
    digest = spec_digest(spec, IDENTITY)
    stage_job, final = jobs(spec)
    assert final["metadata"]["name"] == finalize_job_name(digest) == f"modelstage-finalize-{digest}"
    assert len(final["metadata"]["name"]) <= 63
    assert "completionMode" not in final["spec"] and "MODELSTAGE_WORKERS" not in env(final)
    stage_cmd, final_cmd = container(stage_job)["command"], container(final)["command"]
    assert stage_cmd[:2] == ["modelstage", "stage"] and final_cmd[:2] == ["modelstage", "finalize"]
    assert stage_cmd[2:] == final_cmd[2:], "workers and finalize must plan the same parts"
    assert (
        final["spec"]["template"]["spec"]["volumes"]
        == (stage_job["spec"]["template"]["spec"]["volumes"])
    )
    assert final["metadata"]["labels"] == stage_job["metadata"]["labels"]


@pytest.mark.parametrize("index", [0, 3])
def test_the_stager_cli_reads_the_indexed_jobs_command_and_environment(
    make_spec: SpecFactory, index: int
) -> None:
    """The contract both sides keep: the pod's command parses, and Kubernetes'
    JOB_COMPLETION_INDEX with the operator's MODELSTAGE_WORKERS name the worker's group."""
    from modelstage.stager.cli import build_parser
    from modelstage.stager.scale_out import Group

    spec = make_spec(stager={"parallelism": 4})
    stage_job, final = jobs(spec)
    pod_env = {k: v["value"] for k, v in env(stage_job).items() if "value" in v}
    assert Group.from_env({**pod_env, "JOB_COMPLETION_INDEX": str(index)}) == Group(index, 4)
    for job in (stage_job, final):
        args = build_parser().parse_args(container(job)["command"][1:])
        assert (args.tp, args.digest, args.group) == (2, spec_digest(spec, IDENTITY), None)
    assert build_parser().parse_args(container(final)["command"][1:]).command == "finalize"


def test_formats_with_one_writer_never_get_a_finalize_job(make_spec: SpecFactory) -> None:
    assert len(jobs(make_spec(loadFormat="tensorizer", stager={"parallelism": 4}))) == 1


def test_staging_step_creates_the_next_job_only_after_the_previous_one_succeeded() -> None:
    names = ["stage", "finalize"]
    assert staging_step(names, {}) == StagingStep(create="stage", follow=None)
    assert staging_step(names, {"stage": "Running"}) == StagingStep(None, "stage")
    assert staging_step(names, {"stage": "Failed"}) == StagingStep(None, "stage")
    assert staging_step(names, {"stage": "Succeeded"}) == StagingStep("finalize", None)
    assert staging_step(names, {"stage": "Succeeded", "finalize": "Running"}) == StagingStep(
        None, "finalize"
    )
    assert staging_step(names, {"stage": "Succeeded", "finalize": "Succeeded"}) == StagingStep(
        None, "finalize"
    )
    assert staging_step(["stage"], {"stage": "Succeeded"}) == StagingStep(None, "stage")


@pytest.mark.parametrize(
    ("model", "size_limit", "requested"),
    [
        ({"uri": "hf://acme/llama", "sizeHint": "100Gi"}, "111Gi", "112Gi"),
        ({"uri": "hf://acme/llama"}, "200Gi", None),
        ({"uri": "s3://ckpts/llama", "credentialsSecret": None}, "2Gi", "3Gi"),
        ({"uri": "pvc://ckpts/llama", "credentialsSecret": None}, "2Gi", "3Gi"),
    ],
    ids=["hf-with-size-hint", "hf-without", "s3", "pvc"],
)
def test_the_scratch_volume_and_ephemeral_storage_are_bounded(
    make_spec: SpecFactory, model: dict[str, Any], size_limit: str, requested: str | None
) -> None:
    """Only a hub cache is large (the checkpoint, under HF_HOME on the scratch volume): its
    bound comes from model.sizeHint (+10% + 1Gi; +1Gi more for the container) and is requested so the pod lands on a node
    with room; every format streams into the artifact location, tensorizer included."""
    for fmt in ("sharded_state", "tensorizer"):
        job = plan(make_spec(model=model, loadFormat=fmt))
        pod = job["spec"]["template"]["spec"]
        scratch = {v["name"]: v for v in pod["volumes"]}["modelstage-scratch"]
        assert scratch["emptyDir"] == {"sizeLimit": size_limit}
        resources = container(job).get("resources", {})
        if requested is None:
            assert "ephemeral-storage" not in resources.get("requests", {})
        else:
            assert resources["requests"]["ephemeral-storage"] == requested
            assert resources["limits"]["ephemeral-storage"] == requested
        kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)


def test_a_users_ephemeral_storage_wins(make_spec: SpecFactory) -> None:
    spec = make_spec(
        model={"uri": "hf://acme/llama", "sizeHint": "100Gi"},
        stager={"resources": {"limits": {"ephemeral-storage": "500Gi"}}},
    )
    job = plan(spec)
    pod = job["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["modelstage-scratch"]["emptyDir"] == {
        "sizeLimit": "500Gi"
    }
    assert container(job)["resources"] == {"limits": {"ephemeral-storage": "500Gi"}}
    only_request = plan(make_spec(stager={"resources": {"requests": {"ephemeral-storage": "9Gi"}}}))
    assert container(only_request)["resources"] == {"requests": {"ephemeral-storage": "9Gi"}}


def test_spec_values_that_look_like_flags_reach_the_stager_as_values(
    make_spec: SpecFactory,
) -> None:
    from modelstage.stager.cli import build_parser

    spec = make_spec(
        model={"revision": "--allow-pickle"},
        loadFormat="tensorizer",
        storage={"pvc": None, "s3": {"uri": "s3://models/p", "region": "--allow-pickle",
                                     "endpoint": "http://s3.local"}},
    )  # fmt: skip
    args = build_parser().parse_args(container(plan(spec))["command"][1:])
    assert (args.revision, args.s3_region, args.allow_pickle) == (
        "--allow-pickle",
        "--allow-pickle",
        False,
    )


def test_the_stager_has_a_memory_limit_unless_the_spec_sets_its_resources(
    make_spec: SpecFactory,
) -> None:
    resources = container(plan(make_spec()))["resources"]
    assert resources["limits"]["memory"] and resources["requests"]["memory"]
    for job in jobs(make_spec(stager={"parallelism": 2})):
        assert container(job)["resources"] == resources
    mine = {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
    assert container(plan(make_spec(stager={"resources": mine})))["resources"] == mine


def test_a_service_account_lends_its_cloud_identity_never_an_api_token(
    make_spec: SpecFactory,
) -> None:
    """``stager.serviceAccountName`` is for workload identity (S3); the stager never calls
    the Kubernetes API, so its pods mount no API token whatever the account."""
    spec = make_spec(stager={"serviceAccountName": "s3-reader"})
    for job in jobs(make_spec(stager={"serviceAccountName": "s3-reader", "parallelism": 2})):
        pod = job["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "s3-reader"
        assert pod["automountServiceAccountToken"] is False
    assert plan(spec)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize(
    "source",
    [
        {"model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct", "revision": "main"}},
        {
            "model": {"uri": "s3://ckpts/llama/", "credentialsSecret": None},
            "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}},
            "loadFormat": "tensorizer",
        },
        {"model": {"uri": "pvc://checkpoints/llama", "credentialsSecret": None}},
    ],
    ids=["hf", "s3", "pvc"],
)
def test_the_stager_takes_the_operators_digest_from_the_jobs_own_arguments(
    make_spec: SpecFactory, source: dict[str, Any]
) -> None:
    """One canonical function: what the stager computes from the stage Job's command (without
    the --digest the operator passes) and the resolved identity is the operator's digest."""
    from modelstage.api.modeldeployment import SourceStatus
    from modelstage.stager.cli import build_parser
    from modelstage.stager.stage import StageRequest, request_digest

    spec = make_spec(**source)
    resolved = SourceStatus(uri=spec.model.uri, identity=IDENTITY, resolved_at=datetime.now(UTC),
                            key="k", commit="ab" * 20 if spec.model.scheme == "hf" else None)  # fmt: skip
    digest = spec_digest(spec, resolved.identity)
    job = plan_stage_job(spec, owner=OWNER, artifact=artifact_at(spec, namespace=OWNER.namespace, deployment_name=OWNER.name, digest=digest), source=resolved)
    args = build_parser().parse_args(container(job)["command"][1:])
    request = StageRequest(
        source=args.source, out=args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
        format=args.format, vllm_version=args.vllm_version, revision=args.revision,
        source_uri=args.source_uri,
    )  # fmt: skip
    assert (args.digest, args.expect_identity) == (digest, IDENTITY)
    assert request_digest(request, args.expect_identity) == digest


def test_a_layer_partition_is_staged_for_a_per_rank_format_only(make_spec: SpecFactory) -> None:
    split = make_spec(parallelism={"tensor": 2, "pipeline": 2, "layerPartition": [5, 3]})
    command = container(plan(split))["command"]
    assert "--pp-layer-partition=5,3" in command
    layout = make_spec(parallelism={"tensor": 2, "pipeline": 2, "layerPartition": [5, 3]},
                       loadFormat="safetensors")  # fmt: skip
    assert not any(a.startswith("--pp-layer-partition") for a in container(plan(layout))["command"])
