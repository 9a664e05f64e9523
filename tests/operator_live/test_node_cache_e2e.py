"""Node caching end to end on the real control plane (``KUBEBUILDER_ASSETS``): nothing here is
played but the kubelet. The tenant namespace enforces the ``restricted`` Pod Security Standard.
The operator resolves a real source, stages it, has it copied onto the nodes the workload may
run on and rolls; every Job's pod is created on the API server (Pod Security judges it) and
runs for real as a local process (``support.mini_kubelet``); a copy Job streams the artifact
with a real projected token (TokenRequest, audience ``modelstage-node-agent``, bound to its pod
on its node) to the node agent of its node (a real ``modelstage agent`` process per simulated
node, its own root, the chart's agent role), which reviews the token, verifies every chunk,
keeps the copy under its content and reports it with the namespace's grant.

Proves: copies land only on the nodes the workload's nodeSelector admits, each file equal to
the staged artifact's; the agents label exactly those nodes with the copy's opaque label; the
roll waits for the copies and the warm-up, then mounts the copy through a PV/claim the
operator created (PV controller bound), read-only, with no hostPath anywhere in the tenant
namespace; a serving pod on a node with the copy gets a hit from its prepare (counted in the
status), one on a node without it is refused by the PV's node affinity; a new artifact is
copied while the old one is kept for rollback; the next one, over a budget of two copies,
evicts the oldest (no longer pinned) and never the rollback target; a byte flipped in a
node's copy is found by the agent's re-verification, which drops the copy and reports it
(``verifyFailures``, ``lastVerified``), and the operator has it copied again; a copy that
cannot fit next to the pinned ones is refused before any byte, and the status says which
node and why.

All of it under the chart's three admission policies (rendered from the chart): the agents
run with the chart's agent ServiceAccount and tokens bound to a pod on their node (the
node-name claim), the operator with the chart's ServiceAccount, so its PVs, the serving pods'
read-only claims and the agents' label and report writes all pass them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from modelstage.api.kube_client import resource_path
from modelstage.core import node_cache as nc
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.operator.kube import container_security_context, pod_security_context
from support.charts import RELEASE_NAMESPACE, render_docs
from support.kube_cluster import (
    ApiStatusError,
    Cluster,
    ControlPlane,
    KubeHTTP,
    create_all,
    eventually,
    new_namespace,
)
from support.mini_kubelet import MiniKubelet, PodRefused
from support.modelstage_objects import (
    complete_rollout,
    deploy_path,
    job_path,
    md_path,
    model_deployment,
    vllm_deployment,
)
from support.node_agent import AgentProcess, node_bound_agent_kubeconfig, remove_agent_pods
from support.node_cluster import add_node
from support.operator_flow import MD, status_of, wait_phase
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(420)]
BIN = Path(sys.executable).parent
NODES = {"gpu-a": {"gpu": "true"}, "gpu-b": {"gpu": "true"}, "cpu-c": {}}
BUDGET = 8 * 2**20
"""Each artifact here is 3.2 MB: a node's budget holds two copies, not three."""
SPEC: dict[str, Any] = {
    "model": {"uri": "pvc://models/tiny"},
    "parallelism": {"tensor": 2},
    "loadFormat": "sharded_state",
    "storage": {"pvc": {"claimName": "artifacts", "path": "/staged"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": "vllm"}, "containerName": "vllm"},
    "nodeCache": {"enabled": True, "nodes": "Replicas", "warm": True},
}
VERIFY_RATE = "200M"
"""Re-verification at a pace that reads every copy here within a pass or two."""
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


@pytest.fixture
def cluster(node_cache_cluster: Cluster, real_control_plane: ControlPlane | None) -> Cluster:
    if real_control_plane is None:
        pytest.skip("tokens, Pod Security and the PV binder are the real API server's: "
                    "run with KUBEBUILDER_ASSETS")  # fmt: skip
    return node_cache_cluster


@pytest_asyncio.fixture
async def namespace(cluster: Cluster) -> str:
    """The tenant's namespace, under the restricted Pod Security Standard."""
    import uuid

    name = await new_namespace(cluster, f"t-{uuid.uuid4().hex[:8]}")
    await cluster.client.patch(f"/api/v1/namespaces/{name}", {"metadata": {"labels": RESTRICTED}})
    return name


POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
ADMISSION = "/apis/admissionregistration.k8s.io/v1"


@pytest_asyncio.fixture
async def policies(cluster: Cluster) -> AsyncIterator[None]:
    """The chart's node-cache admission policies, in force (a pod mounting a node-cache claim
    writable is denied) until the test ends; then removed (the control plane outlives it)."""
    docs = [d for d in render_docs("--set", "nodeCache.enabled=true") if d["kind"] in POLICY_KINDS]
    assert len(docs) == 6
    await create_all(cluster.client, docs)
    pods = f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods"
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "writable-node-cache"},
             "spec": {"containers": [{"name": "c", "image": "x"}],
                      "volumes": [{"name": "v", "persistentVolumeClaim": {
                          "claimName": "modelstage-node-cache-probe"}}]}}  # fmt: skip

    async def in_force() -> bool:
        try:
            await cluster.client.create(pods, probe)
        except ApiStatusError as error:
            return "ValidatingAdmissionPolicy" in str(error.body)
        await cluster.client.request("DELETE", f"{pods}/writable-node-cache",
                                     gracePeriodSeconds="0")  # fmt: skip
        return False

    await eventually(in_force, timeout=30, what="the chart's admission policies in force")
    try:
        yield
    finally:
        for doc in docs:
            plural = "validatingadmissionpolicies" if doc["kind"] == POLICY_KINDS[0] else (
                "validatingadmissionpolicybindings")  # fmt: skip
            await cluster.client.delete(f"{ADMISSION}/{plural}/{doc['metadata']['name']}")


@pytest_asyncio.fixture
async def operator(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> AsyncIterator[OperatorProcess]:
    """The operator with node caching installed (the chart's ``nodeCache.enabled``)."""
    env = {"MODELSTAGE_OPERATOR_NODE_CACHE": "true"}
    process = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, extra_env=env)
    await process.start()
    try:
        yield process
    finally:
        await process.stop(graceful=False)


@pytest.fixture
def world(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    """The claims' folders (the source checkpoint, bf16, in ``models``) and each node's root."""
    claims = tmp_path / "claims"
    write_checkpoint(SyntheticModel(dtype="bfloat16", num_shards=2), claims / "models" / "tiny")
    roots = {name: tmp_path / "nodes" / name for name in NODES}
    for root in roots.values():
        root.mkdir(parents=True)
    return claims, roots


@pytest_asyncio.fixture
async def running(
    cluster: Cluster,
    namespace: str,
    policies: None,
    operator: OperatorProcess,
    world: tuple[Path, dict[str, Path]],
    tmp_path: Path,
) -> AsyncIterator[tuple[MiniKubelet, list[AgentProcess]]]:
    """The Nodes, an agent per node (under the chart's agent role) and the kubelet that runs
    every Job of the namespace."""
    claims, roots = world
    for name, labels in NODES.items():
        await add_node(cluster, name, labels)
    agents = [
        AgentProcess(name, root, BUDGET, await node_bound_agent_kubeconfig(
            cluster, name, tmp_path / f"{name}.kubeconfig"), tmp_path / f"{name}.log",
            interval=0.5, verify_rate=VERIFY_RATE).start()
        for name, root in roots.items()
    ]  # fmt: skip
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    try:
        async with MiniKubelet(cluster, namespace, claims, roots, scratch) as kubelet:
            yield kubelet, agents
    finally:
        for agent in agents:
            await agent.stop()
        await remove_agent_pods(cluster)
        for pv in await cluster.client.list(resource_path("v1", "persistentvolumes")):
            await cluster.client.delete(resource_path("v1", "persistentvolumes", None,
                                                      pv["metadata"]["name"]))  # fmt: skip


def workload() -> dict[str, Any]:
    """Two replicas that may run only on the GPU nodes, restricted like the namespace."""
    deployment = vllm_deployment(replicas=2, model_deployment=MD)
    pod = deployment["spec"]["template"]["spec"]
    pod["nodeSelector"] = {"gpu": "true"}
    pod["securityContext"] = pod_security_context()
    pod["containers"][0]["securityContext"] = container_security_context()
    return deployment


async def node_labels(cluster: Cluster, name: str) -> dict[str, str]:
    body = await cluster.client.get(resource_path("v1", "nodes", None, name)) or {}
    return dict(body.get("metadata", {}).get("labels") or {})


async def report(cluster: Cluster, name: str) -> dict[str, Any]:
    body = await cluster.client.get(resource_path(nc.API_VERSION, nc.PLURAL, None, name)) or {}
    return dict(body.get("status") or {})


async def granted(cluster: Cluster, node: str, ns: str, digest: str) -> dict[str, Any] | None:
    """The node's copy granted to (ns, digest), as its agent reports it."""
    for held in (await report(cluster, node)).get("copies") or []:
        if {"namespace": ns, "digest": digest} in held.get("grants") or []:
            return dict(held)
    return None


async def rolled(cluster: Cluster, ns: str, before: str | None = None) -> str:
    """The digest of the next artifact the workload is rolled onto (after ``before``)."""

    async def probe() -> str | None:
        status = await status_of(cluster, ns)
        digest = (status.get("artifact") or {}).get("digest")
        if status.get("phase") == "RollingOut" and digest and digest != before:
            return str(digest)
        return None

    return await eventually(probe, timeout=180, what=f"a roll after {before}")


async def settle(cluster: Cluster, ns: str) -> None:
    """The Deployment controller's part: every replica on the new template; and every copy
    Job finished (the kubelet records a Job as it ends: a step counts only its own)."""
    await complete_rollout(cluster.client, ns)
    await wait_phase(cluster, ns, "Ready", timeout=60)

    async def copies_finished() -> bool:
        jobs = await cluster.client.list(job_path(ns))
        return all((j.get("status") or {}).get("conditions") for j in jobs
                   if j["metadata"]["name"].startswith("modelstage-copy-"))  # fmt: skip

    await eventually(copies_finished, timeout=60, what="every copy Job finished")


def same_files(staged: Path, copied: Path) -> bool:
    """Every file of the staged artifact, byte for byte, in the copy (whose manifest is the
    canonical form of the staged one)."""
    for path in staged.iterdir():
        if path.name == "modelstage.json":
            continue
        if (copied / path.name).read_bytes() != path.read_bytes():
            return False
    canonical = nc.canonical_manifest((staged / "modelstage.json").read_bytes())
    return (copied / "modelstage.json").read_bytes() == canonical


def host_paths(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        found = ["hostPath"] if "hostPath" in obj else []
        return found + [p for v in obj.values() for p in host_paths(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in host_paths(v)]
    return []


async def tenant_objects(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for api, plural in (("batch/v1", "jobs"), ("v1", "pods"), ("apps/v1", "deployments"),
                        ("v1", "persistentvolumeclaims")):  # fmt: skip
        found += await cluster.client.list(resource_path(api, plural, ns))
    return found


async def test_copied_to_the_matching_nodes_served_through_a_pv_and_refused_over_budget(
    cluster: Cluster,
    namespace: str,
    running: tuple[MiniKubelet, list[AgentProcess]],
    world: tuple[Path, dict[str, Path]],
    tmp_path: Path,
) -> None:
    kubelet, agents = running
    claims, roots = world
    gpus = ("gpu-a", "gpu-b")
    await cluster.client.create(deploy_path(namespace, None), workload())
    await cluster.client.create(md_path(namespace), model_deployment(MD, SPEC))

    try:
        first = await rolled(cluster, namespace)
    except AssertionError as error:
        raise AssertionError(
            f"{error}\nstatus: {await status_of(cluster, namespace)}\nran: {kubelet.ran}\n"
            f"refused: {kubelet.refused}\nreports: {[await report(cluster, n) for n in NODES]}"
        ) from None
    assert kubelet.refused == []
    status = await status_of(cluster, namespace)
    assert status["nodeCache"]["phase"] == "Ready", status["nodeCache"]
    assert sorted(n["name"] for n in status["nodeCache"]["nodes"]) == list(gpus)
    staged = next(claims.glob(f"artifacts/staged/**/{first}"))
    contents = set()
    for name in gpus:  # every byte as staged, granted to this namespace, the node labelled
        held = await granted(cluster, name, namespace, first)
        assert held is not None, await report(cluster, name)
        contents.add(held["content"])
        assert same_files(staged, roots[name] / held["content"]), name
        assert (await node_labels(cluster, name)).get(nc.content_label(held["content"])) == "true"
        assert not any(first in key for key in await node_labels(cluster, name))
    (content,) = contents
    for agent in agents:  # read into the page cache before the roll, on the GPU nodes only
        warmed = content in agent.log.read_text() and "warm" in agent.log.read_text()
        assert warmed == (agent.node in gpus), agent.node
    assert not [p for p in roots["cpu-c"].iterdir() if not p.name.startswith(".")]
    copies = [r for r in kubelet.ran if r["name"].startswith("modelstage-copy-")]
    assert sorted(r["node"] for r in copies) == list(gpus) and all(r["rc"] == 0 for r in copies)
    assert all(json.loads(r["message"])["content"] == content for r in copies), copies

    # The serving pods' copy: the operator's PV (bound by the PV controller) and claim.
    deployment = await cluster.client.get(deploy_path(namespace)) or {}
    template = deployment["spec"]["template"]
    (cache,) = [v for v in template["spec"]["volumes"] if v["name"] == "modelstage-node-cache"]
    claim = cache["persistentVolumeClaim"]
    assert claim == {"claimName": f"modelstage-node-cache-{content[:20]}", "readOnly": True}
    assert nc.CACHE_GID in template["spec"]["securityContext"]["supplementalGroups"]
    assert template["spec"]["nodeSelector"] == {"gpu": "true"}  # the user's placement kept
    for obj in await tenant_objects(cluster, namespace):
        assert host_paths(obj) == [], f"{obj['kind']} {obj['metadata']['name']}"

    async def bound() -> bool:
        pvc = await cluster.client.get(resource_path(
            "v1", "persistentvolumeclaims", namespace, claim["claimName"])) or {}  # fmt: skip
        return (pvc.get("status") or {}).get("phase") == "Bound"

    await eventually(bound, timeout=60, what="the node-cache claim bound to its PV")
    summary = json.loads(await kubelet.start_serving_pod(template, "gpu-a", "vllm-on-gpu-a"))
    assert summary["nodeCache"]["result"] == "hit", summary
    with pytest.raises(PodRefused, match="node affinity excludes cpu-c"):
        await kubelet.start_serving_pod(template, "cpu-c", "vllm-on-cpu-c")

    async def counted() -> bool:
        nodes = (await status_of(cluster, namespace))["nodeCache"]["nodes"]
        return any(n["name"] == "gpu-a" and n.get("hits") == 1 for n in nodes)

    await eventually(counted, timeout=60, what="the hit counted on gpu-a")
    await settle(cluster, namespace)

    # A new artifact: copied while the first one serves, then rolled; the first one is the
    # rollback target, kept (the budget holds both).
    await cluster.client.patch(md_path(namespace, MD), {"spec": {"dtype": "float16"}})
    second = await rolled(cluster, namespace, first)
    for name in gpus:
        assert await granted(cluster, name, namespace, first) is not None, name
        assert await granted(cluster, name, namespace, second) is not None, name
        spec = (await cluster.client.get(resource_path(nc.API_VERSION, nc.PLURAL, None, name))
                or {}).get("spec") or {}  # fmt: skip
        kept = {(k["namespace"], k["digest"]) for k in spec.get("keep") or []}
        assert {(namespace, first), (namespace, second)} <= kept, spec
    await settle(cluster, namespace)

    # A third, over a budget of two copies: the offer evicts the oldest copy, no longer
    # pinned, and never the second, the rollback target once the third serves.
    await cluster.client.patch(md_path(namespace, MD), {"spec": {"parallelism": {"tensor": 1}}})
    third = await rolled(cluster, namespace, second)
    assert (await status_of(cluster, namespace))["previousArtifact"]["digest"] == second
    for name in gpus:
        assert await granted(cluster, name, namespace, first) is None, await report(cluster, name)
        assert await granted(cluster, name, namespace, second) is not None, name
        assert await granted(cluster, name, namespace, third) is not None, name
        assert (await report(cluster, name))["evictions"] >= 1, name
        assert not (roots[name] / content).exists(), name
    await settle(cluster, namespace)

    # A byte flipped in gpu-a's copy of the served artifact: the agent's re-verification
    # drops the copy and says so; the operator sees gpu-a no longer holds it and a copy Job
    # copies it again.
    held = await granted(cluster, "gpu-a", namespace, third)
    assert held is not None and held.get("lastVerified"), held
    served = roots["gpu-a"] / held["content"]
    victim = next(p for p in sorted(served.iterdir()) if p.name != "modelstage.json")
    victim.chmod(0o640)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    victim.chmod(0o440)
    ran_before = len(kubelet.ran)  # every Job so far (settled: each earlier one finished)

    async def dropped() -> bool:
        now = await report(cluster, "gpu-a")
        gone = await granted(cluster, "gpu-a", namespace, third) is None
        return bool(now.get("verifyFailures")) and (gone or len(kubelet.ran) > ran_before)

    await eventually(dropped, timeout=60, what="gpu-a's corrupt copy dropped by re-verification")

    async def copied_again() -> bool:
        again = await granted(cluster, "gpu-a", namespace, third)
        return again is not None and same_files(staged_of(claims, third), served)

    try:
        await eventually(copied_again, timeout=120, what="gpu-a's copy made again by a copy Job")
    except AssertionError as error:
        status = await status_of(cluster, namespace)
        raise AssertionError(f"{error}\nphase: {status.get('phase')}\ncache: "
                             f"{status.get('nodeCache')}\nconditions: {status.get('conditions')}"
                             f"\nran: {[(r['name'], r['node'], r['rc']) for r in kubelet.ran]}"
                             ) from None  # fmt: skip
    recopies = [r for r in kubelet.ran[ran_before:] if r["name"].startswith("modelstage-copy-")]
    assert [r["node"] for r in recopies] == ["gpu-a"] and recopies[0]["rc"] == 0, recopies
    assert (await report(cluster, "gpu-a"))["verifyFailures"] == 1
    assert (await report(cluster, "gpu-b")).get("verifyFailures", 0) == 0

    # The policies held the agents and the operator to their part all along.
    await refused_by_policy(tmp_path / "gpu-a.kubeconfig", "patch",
                            resource_path("v1", "nodes", None, "gpu-b"),
                            {"metadata": {"labels": {nc.content_label(content): "true"}}})
    await refused_by_policy(cluster.kubeconfig, "create", resource_path("v1", "persistentvolumes"),
                            {"apiVersion": "v1", "kind": "PersistentVolume",
                             "metadata": {"name": "modelstage-nc-not-a-copy"},
                             "spec": {"capacity": {"storage": "1"}, "accessModes": ["ReadOnlyMany"],
                                      "hostPath": {"path": "/"}}})  # fmt: skip

    # A fourth does not fit next to the two kept ones (the ModelDeployment now keeps three):
    # the agents refuse it before any byte, and the status says which node and why.
    await cluster.client.patch(md_path(namespace, MD), {"spec": {"dtype": "bfloat16",
                                                                 "retention": {"keep": 3}}})

    async def refused() -> dict[str, Any] | None:
        cache = (await status_of(cluster, namespace)).get("nodeCache") or {}
        nodes = {n["name"]: n for n in cache.get("nodes") or []}
        if all(nodes.get(g, {}).get("state") == "Failed" for g in gpus):
            return cache
        return None

    cache = await eventually(refused, timeout=180, what="the fourth copy refused on both nodes")
    for node in cache["nodes"]:
        assert "budget" in node["message"] and node["name"] in node["message"], node
    status = await status_of(cluster, namespace)
    (cached,) = [c for c in status["conditions"] if c["type"] == "NodeCached"]
    assert cached["reason"] == "CopyFailed" and "gpu-a" in cached["message"], cached
    assert "budget" in cached["message"], cached
    for name in gpus:
        assert not [p for p in (roots[name] / ".partial").glob("*") if p.is_dir()], name
        assert await granted(cluster, name, namespace, second) is not None, name
        assert await granted(cluster, name, namespace, third) is not None, name
    assert kubelet.refused == []


def staged_of(claims: Path, digest: str) -> Path:
    return next(claims.glob(f"artifacts/staged/**/{digest}"))


async def refused_by_policy(kubeconfig: Path, verb: str, path: str, body: dict[str, Any]) -> None:
    """The write, with the kubeconfig's token, is denied by one of the chart's policies."""
    import yaml

    config = yaml.safe_load(kubeconfig.read_text())
    token = config["users"][0]["user"]["token"]
    async with KubeHTTP(config["clusters"][0]["cluster"]["server"], token) as client:
        with pytest.raises(ApiStatusError) as denied:
            await (client.patch(path, body) if verb == "patch" else client.create(path, body))
    assert "ValidatingAdmissionPolicy" in str(denied.value.body), denied.value
