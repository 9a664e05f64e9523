"""The node-local copy's PV and claim, each node's NodeCache spec, retention's pins, and a walk
over every object the operator plans in a tenant's namespace: no hostPath, no privilege."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
from modelstage.api.modeldeployment import (
    ArtifactStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
)
from modelstage.api.objects import Owner
from modelstage.core import node_cache as nc
from modelstage.operator.artifact import artifact_at, artifact_for
from modelstage.operator.claim_plan import plan_claim
from modelstage.operator.job_plan import plan_cleanup_job, plan_resolve_job, staging_jobs
from modelstage.operator.node_cache_plan import plan_copy_job
from modelstage.operator.node_cache_spec import CacheUse, plan_node_spec, spec_patch
from modelstage.operator.node_cache_volume import (
    claim_name,
    plan_volume,
    released,
    volume_name,
)
from modelstage.operator.patch import apply_merge_patch
from modelstage.operator.retention import pinned_digests
from modelstage.operator.rollout_plan import plan_rollout
from modelstage.operator.settings import OperatorConfig

from .conftest import SpecFactory

OWNER = Owner(name="llama", namespace="team-a", uid="uid-1")
CONTENT = "0123456789abcdef" * 2
IDENTITY = "commit:" + "ab" * 20


def test_a_pv_per_namespace_and_content_pre_bound_to_the_tenants_claim() -> None:
    pv, pvc = plan_volume(OWNER, CONTENT, 12345, root="/mnt/nvme/cache")
    assert pvc["metadata"]["name"] == claim_name(CONTENT) == "modelstage-node-cache-" + CONTENT[:20]
    assert pv["metadata"]["name"] == volume_name("team-a", CONTENT)
    assert pv["metadata"]["name"] != volume_name("team-b", CONTENT)  # one per namespace
    assert len(pv["metadata"]["name"]) == len("modelstage-nc-") + 24
    spec = pv["spec"]
    assert spec["local"] == {"path": f"/mnt/nvme/cache/{CONTENT}"}
    assert spec["claimRef"]["namespace"] == "team-a"
    assert spec["claimRef"]["name"] == pvc["metadata"]["name"]
    assert spec["accessModes"] == ["ReadOnlyMany"]
    assert spec["persistentVolumeReclaimPolicy"] == "Retain"
    assert spec["storageClassName"] == pvc["spec"]["storageClassName"] == "modelstage-node-cache"
    [term] = spec["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": nc.content_label(CONTENT), "operator": "In", "values": ["true"]}
    ]
    assert spec["capacity"] == pvc["spec"]["resources"]["requests"] == {"storage": "12345"}
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["metadata"]["namespace"] == "team-a"
    assert pvc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    kubernetes_validate.validate(pv, "1.28", strict=True)
    kubernetes_validate.validate(pvc, "1.28", strict=True)
    with pytest.raises(Exception, match="content address"):
        plan_volume(OWNER, "../etc", 1)


def test_a_pv_whose_claim_is_gone_is_released() -> None:
    pv, pvc = plan_volume(OWNER, CONTENT, 1)
    assert not released(pv, None)  # not bound yet: its claim comes right after it
    pvc["metadata"]["uid"] = "claim-1"
    pv["spec"]["claimRef"]["uid"] = "claim-1"  # bound by the PV controller
    assert not released(pv, pvc)
    assert released(pv, None)
    assert released(pv, {**pvc, "metadata": {**pvc["metadata"], "uid": "claim-2"}})
    foreign = {**pv, "metadata": {"name": "someone-elses", "labels": {}}}
    assert not released(foreign, None)  # not one of ours: never deleted


def status_with(*digests: str, keep: int = 2) -> ModelDeploymentStatus:
    history = [
        ArtifactStatus(digest=d, uri=f"pvc://m/a/{d}", format="sharded_state",
                       tensor_parallel_size=1)
        for d in digests
    ]  # fmt: skip
    return ModelDeploymentStatus(phase="Ready", artifact=history[0], artifacts=history)


def test_pins_are_retentions_rule() -> None:
    status = status_with("d1", "d2", "d3")
    assert pinned_digests(status, 2, "d9") == {"d1", "d2", "d9"}
    assert pinned_digests(status, 1, None) == {"d1"}


def test_each_node_keeps_every_pin_and_warms_what_lists_it() -> None:
    uses = [
        CacheUse("team-b", frozenset({"d2"})),
        CacheUse("team-a", frozenset({"d1", "d0"}), warming="d1", nodes=frozenset({"n1"})),
    ]
    spec = plan_node_spec("n1", uses)
    assert [(g.namespace, g.digest) for g in spec.keep] == [
        ("team-a", "d0"), ("team-a", "d1"), ("team-b", "d2")
    ]  # fmt: skip
    assert [(g.namespace, g.digest) for g in spec.warm] == [("team-a", "d1")]
    assert plan_node_spec("n2", uses).warm == []
    patch = spec_patch({}, spec)
    assert patch is not None and patch["spec"]["warm"] == [{"namespace": "team-a", "digest": "d1"}]
    assert spec_patch(patch["spec"], spec) is None


def test_node_caching_is_off_unless_installed() -> None:
    assert OperatorConfig.from_env({}).node_cache is False
    env = {
        "MODELSTAGE_OPERATOR_NODE_CACHE": "true",
        "MODELSTAGE_OPERATOR_NODE_CACHE_COPY_DEADLINE_SECONDS": "60",
    }
    config = OperatorConfig.from_env(env)
    assert (config.node_cache, config.copy_deadline_seconds) == (True, 60)


# --- every object planned in a tenant namespace ------------------------------------------------

HOST_FIELDS = ("hostNetwork", "hostPID", "hostIPC", "hostUsers")


def _walk(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}.{key}", value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{path}[{i}]")


def unsafe(obj: Any) -> list[str]:
    """Whatever in ``obj`` would let a pod out of the restricted Pod Security standard."""
    found = []
    for path, value in _walk(obj):
        key = path.rsplit(".", 1)[-1]
        if key == "hostPath" or (key in HOST_FIELDS and value is True):
            found.append(path)
        if key in ("privileged", "allowPrivilegeEscalation") and value is True:
            found.append(path)
        if key == "add" and ".capabilities" in path and value:
            found.append(path)
        if key == "runAsNonRoot" and value is False:
            found.append(path)
    return found


def tenant_objects(make_spec: SpecFactory, deployment: dict[str, Any]) -> list[dict[str, Any]]:
    s3 = {"pvc": None, "s3": {"uri": "s3://models/prefix", "credentialsSecret": "creds"}}
    specs: list[ModelDeploymentSpec] = [
        make_spec(nodeCache={"enabled": True}),
        make_spec(storage=s3, loadFormat="runai_streamer_sharded", nodeCache={"enabled": True}),
    ]
    objects: list[dict[str, Any]] = []
    for spec in specs:
        a = artifact_for(spec, namespace="team-a", deployment_name="llama", identity=IDENTITY)
        objects += staging_jobs(spec, owner=OWNER, artifact=artifact_at(spec, namespace=OWNER.namespace, deployment_name=OWNER.name, digest=a.digest))
        objects.append(plan_resolve_job(spec, owner=OWNER, name="modelstage-resolve-x"))
        claim = plan_claim(spec, owner=OWNER)
        objects += [claim] if claim is not None else []
        status = ArtifactStatus(digest=a.digest, uri=a.location.uri, format="sharded_state",
                                tensor_parallel_size=2)  # fmt: skip
        cleanup = plan_cleanup_job(
            status, namespace="team-a", owner_name="llama",
            connection=spec.storage.s3, image="stager:1",
        )  # fmt: skip
        objects += [cleanup] if cleanup is not None else []
        objects.append(plan_copy_job(spec, a, "n1", owner=OWNER, endpoint="http://10.0.0.1:9103"))
        objects.append(plan_volume(OWNER, CONTENT, 100)[1])
        patch = plan_rollout(spec, a, deployment, node_cache_claim=claim_name(CONTENT))
        objects.append(apply_merge_patch(deployment, patch.merge_patch))
    return objects


def test_nothing_the_operator_plans_in_a_tenant_namespace_mounts_the_host_or_escalates(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    objects = tenant_objects(make_spec, deployment)
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"Job", "PersistentVolumeClaim", "Deployment"}
    for obj in objects:
        assert unsafe(obj) == [], f"{obj['kind']} {obj['metadata'].get('name')}"


def test_the_walk_finds_a_host_path() -> None:
    pod = {"spec": {"volumes": [{"name": "x", "hostPath": {"path": "/"}}], "hostPID": True}}
    assert unsafe(pod) == [".spec.volumes[0].hostPath", ".spec.hostPID"]
