"""A LeaderWorkerSet target (multi-node serving): the roll patches the leader and the worker
templates in one merge patch, a Ray worker gets all but the argument rewrite, validation reads
every template, and the rollout is read from the set's status and its leader pods (it has no
``observedGeneration``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from modelstage.api.modeldeployment import ModelDeploymentSpec
from modelstage.api.objects import DIGEST_ANNOTATION
from modelstage.core.errors import SpecError
from modelstage.operator.artifact import Artifact, artifact_for
from modelstage.operator.kube import PLUGIN_DIR
from modelstage.operator.observations import observe_workload, pod_failures
from modelstage.operator.patch import apply_merge_patch
from modelstage.operator.rollout_plan import PREPARE_CONTAINER, plan_rollout
from modelstage.operator.validation import validate_workload
from modelstage.operator.workload_kinds import (
    LEADER_TEMPLATE,
    WORKER_TEMPLATE,
    get_path,
    pod_selector,
    serving_template,
)
from pydantic import ValidationError

from .conftest import EXAMPLES, load_yaml

SpecFactory = Callable[..., ModelDeploymentSpec]
IDENTITY = "commit:" + "cd" * 20
LWS_TARGET = {"targetRef": {"kind": "LeaderWorkerSet", "name": "vllm-llama-mn"}}
RAY_WORKER = {
    "name": "vllm",
    "image": "vllm/vllm-openai:v0.32.0",
    "command": ["ray", "start", "--address=$(LWS_LEADER_ADDRESS):6379", "--block"],
    "resources": {"limits": {"nvidia.com/gpu": 2}},
}


@pytest.fixture
def lws() -> dict[str, Any]:
    """The example LeaderWorkerSet, with the fields the API server adds."""
    workload: dict[str, Any] = load_yaml(EXAMPLES / "vllm-leaderworkerset.yaml")
    workload["metadata"].update(namespace="llm", resourceVersion="7", generation=1)
    return workload


@pytest.fixture
def spec(make_spec: SpecFactory) -> ModelDeploymentSpec:
    return make_spec(parallelism={"tensor": 2, "pipeline": 2}, serving=LWS_TARGET)


def artifact(spec: ModelDeploymentSpec) -> Artifact:
    return artifact_for(spec, namespace="llm", deployment_name="llama-70b", identity=IDENTITY)


def rolled(spec: ModelDeploymentSpec, workload: dict[str, Any]) -> dict[str, Any]:
    patched: dict[str, Any] = apply_merge_patch(
        workload, plan_rollout(spec, artifact(spec), workload).merge_patch
    )
    return patched


def container(workload: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    template = get_path(workload, path)
    assert template is not None
    first: dict[str, Any] = template["spec"]["containers"][0]
    return first


def flag(args: list[str], name: str) -> str:
    for i, token in enumerate(args):
        if token == name:
            return args[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def test_both_templates_are_rolled_in_one_patch_with_vllms_multi_node_arguments(
    spec: ModelDeploymentSpec, lws: dict[str, Any]
) -> None:
    art = artifact(spec)
    plan = plan_rollout(spec, art, lws)
    assert set(plan.merge_patch) == {"spec"}
    assert set(plan.merge_patch["spec"]["leaderWorkerTemplate"]) == {
        "leaderTemplate",
        "workerTemplate",
    }
    after = apply_merge_patch(lws, plan.merge_patch)
    for path in (LEADER_TEMPLATE, WORKER_TEMPLATE):
        vllm = container(after, path)
        args = vllm["args"]
        assert args[0] == art.location.path  # vllm serve's positional model
        assert flag(args, "--load-format") == "modelstage_sharded_state"
        assert (flag(args, "--tensor-parallel-size"), flag(args, "--pipeline-parallel-size")) == (
            "2",
            "2",
        )
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        assert env["MODELSTAGE_DIGEST"] == art.digest and env["MODELSTAGE_TP"] == "2"
        assert env["PYTHONPATH"].split(":")[0] == PLUGIN_DIR
        template = get_path(after, path)
        assert template is not None
        assert template["metadata"]["annotations"][DIGEST_ANNOTATION] == art.digest
        (prepare,) = template["spec"]["initContainers"]
        assert prepare["name"] == PREPARE_CONTAINER
        assert prepare["command"][prepare["command"].index("--pp") + 1] == "2"
    # The user's multi-node flags stay where they were.
    worker = container(after, WORKER_TEMPLATE)["args"]
    assert "--headless" in worker and "--node-rank=$(LWS_WORKER_INDEX)" in worker
    assert "--node-rank=0" in container(after, LEADER_TEMPLATE)["args"]
    assert plan.template == get_path(after, LEADER_TEMPLATE)
    assert plan_rollout(spec, art, after).merge_patch == {}


def test_a_ray_worker_gets_everything_but_the_argument_rewrite(
    spec: ModelDeploymentSpec, lws: dict[str, Any]
) -> None:
    get_path(lws, WORKER_TEMPLATE)["spec"]["containers"] = [copy.deepcopy(RAY_WORKER)]  # type: ignore[index]
    art = artifact(spec)
    after = rolled(spec, lws)
    worker = container(after, WORKER_TEMPLATE)
    assert worker["command"] == RAY_WORKER["command"] and "args" not in worker
    assert {"name": "MODELSTAGE_DIGEST", "value": art.digest} in worker["env"]
    assert any(m["mountPath"] == PLUGIN_DIR for m in worker["volumeMounts"])
    template = get_path(after, WORKER_TEMPLATE)
    assert template is not None
    assert [c["name"] for c in template["spec"]["initContainers"]] == [PREPARE_CONTAINER]
    assert flag(container(after, LEADER_TEMPLATE)["args"], "--load-format") == (
        "modelstage_sharded_state"
    )
    assert plan_rollout(spec, art, after).merge_patch == {}


def test_without_a_leader_template_the_worker_template_is_the_serving_one(
    spec: ModelDeploymentSpec, lws: dict[str, Any]
) -> None:
    del lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    plan = plan_rollout(spec, artifact(spec), lws)
    assert set(plan.merge_patch["spec"]["leaderWorkerTemplate"]) == {"workerTemplate"}
    after = apply_merge_patch(lws, plan.merge_patch)
    digest = serving_template(after)["metadata"]["annotations"][DIGEST_ANNOTATION]
    assert digest == artifact(spec).digest


def test_a_worker_that_runs_neither_vllm_nor_ray_is_refused_naming_the_template(
    spec: ModelDeploymentSpec, lws: dict[str, Any]
) -> None:
    worker = container(lws, WORKER_TEMPLATE)
    worker["command"], worker["args"] = ["python", "serve.py"], []
    with pytest.raises(SpecError, match="found no vLLM invocation"):
        plan_rollout(spec, artifact(spec), lws)
    (finding,) = validate_workload(spec, lws, namespace="llm", deployment_name="llama-70b")
    assert finding.reason == "VllmCommandNotRecognized"
    assert "LeaderWorkerSet vllm-llama-mn (workerTemplate), container vllm" in finding.message


def test_the_gpus_are_counted_over_the_group(
    make_spec: SpecFactory, spec: ModelDeploymentSpec, lws: dict[str, Any]
) -> None:
    assert validate_workload(spec, lws, namespace="llm", deployment_name="llama-70b") == []
    bigger = make_spec(parallelism={"tensor": 4, "pipeline": 2}, serving=LWS_TARGET)
    (finding,) = validate_workload(bigger, lws, namespace="llm", deployment_name="llama-70b")
    assert finding.reason == "InsufficientGPUs"
    assert "a group of 2 pods of LeaderWorkerSet vllm-llama-mn requests 4" in finding.message


def test_node_and_engine_caching_are_refused_for_a_leaderworkerset(
    spec_dict: Callable[..., dict[str, Any]],
) -> None:
    for cache in ("nodeCache", "engineCache"):
        with pytest.raises(ValidationError, match="does not support node caching"):
            ModelDeploymentSpec.model_validate(
                spec_dict(serving=LWS_TARGET, **{cache: {"enabled": True}})
            )


def leader(digest: str | None, *, group: int = 0, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"vllm-llama-mn-{group}",
            "labels": {
                "leaderworkerset.sigs.k8s.io/name": "vllm-llama-mn",
                "leaderworkerset.sigs.k8s.io/worker-index": "0",
            },
            "annotations": {DIGEST_ANNOTATION: digest} if digest else {},
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def with_status(lws: dict[str, Any], digest: str, **status: Any) -> dict[str, Any]:
    out = copy.deepcopy(lws)
    for path in (LEADER_TEMPLATE, WORKER_TEMPLATE):
        template = get_path(out, path)
        assert template is not None
        template.setdefault("metadata", {})["annotations"] = {DIGEST_ANNOTATION: digest}
    out["status"] = status
    return out


AVAILABLE = [{"type": "Available", "status": "True", "reason": "AllGroupsReady"}]


def test_a_status_from_before_the_patch_is_not_a_finished_roll(lws: dict[str, Any]) -> None:
    """The set's status says all groups are updated and ready, but that was of the previous
    templates: its leader pods still carry the old digest."""
    workload = with_status(lws, "new", replicas=2, readyReplicas=2, updatedReplicas=2,
                           conditions=AVAILABLE)  # fmt: skip
    seen = observe_workload(workload, (), [leader("old", group=0), leader("old", group=1)])
    assert seen.digest == "new" and (seen.updated, seen.replicas) == (0, 2)
    assert not seen.complete


def test_a_roll_is_complete_when_the_leaders_and_the_sets_status_agree(
    lws: dict[str, Any],
) -> None:
    pods = [leader("new", group=0), leader("new", group=1)]
    updating = with_status(
        lws, "new", replicas=2, readyReplicas=2, updatedReplicas=2,
        conditions=[{"type": "UpdateInProgress", "status": "True"},
                    {"type": "Progressing", "status": "True"}],
    )  # fmt: skip
    assert not observe_workload(updating, (), pods).complete
    one_unready = [leader("new", group=0), leader("new", group=1, ready=False)]
    done = with_status(lws, "new", replicas=2, readyReplicas=2, updatedReplicas=2,
                       conditions=AVAILABLE)  # fmt: skip
    assert observe_workload(done, (), one_unready).available == 1
    seen = observe_workload(done, (), pods)
    assert (seen.updated, seen.available, seen.complete, seen.stalled) == (2, 2, True, False)


def test_a_crash_looping_leader_of_the_new_digest_is_a_failure(lws: dict[str, Any]) -> None:
    crashing = leader("new")
    crashing["status"]["containerStatuses"] = [
        {"name": "vllm", "restartCount": 4, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
    ]
    (reason,) = pod_failures([crashing, leader("old", group=1)], "new")
    assert "vllm-llama-mn-0" in reason and "CrashLoopBackOff" in reason
    assert pod_selector(lws) == {"leaderworkerset.sigs.k8s.io/name": "vllm-llama-mn"}


def test_a_leader_that_only_joins_ray_is_refused(
    spec: ModelDeploymentSpec, lws: dict[str, Any]
) -> None:
    """The leader serves the API: its vLLM command line is what the roll must rewrite."""
    get_path(lws, LEADER_TEMPLATE)["spec"]["containers"] = [copy.deepcopy(RAY_WORKER)]  # type: ignore[index]
    (finding,) = validate_workload(spec, lws, namespace="llm", deployment_name="llama-70b")
    assert finding.reason == "VllmCommandNotRecognized"
    assert finding.message.startswith("LeaderWorkerSet vllm-llama-mn, container vllm:")
