"""Node caching, the operator's side, live: the operator process against the tests' API (kmock,
or the real API server with ``KUBEBUILDER_ASSETS``). The tests play the node agents (they
write the ``NodeCache`` reports) and the Job controller (they finish the copy Jobs as the
existing tests finish stager Jobs); Nodes are created through the API.

Proven here: staged -> copy Jobs on the matching nodes only (nodeSelector, taints, an agent's
fresh report naming its copy endpoint) -> Ready once the reports grant the namespace the copy
-> the copy's PV and claim, then the roll with the claim read-only, ``--node-cache`` and the
copies' group; each node's NodeCache spec keeps what the ModelDeployment pins; the deadline
rolls anyway, without the node-cache volume, with ``DeadlinePassed`` (condition and Warning
event); a node that loses its copy shows in the status; pods' hits and misses per node; the
PV goes once its claim is gone.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from modelstage.api.kube_client import resource_path
from modelstage.core import node_cache as nc
from modelstage.operator.node_cache_plan import COPY_CONTAINER, NODE_ANNOTATION, copy_job_name
from modelstage.operator.node_cache_volume import claim_name, volume_name
from support.kube_cluster import (
    Cluster,
    eventually,
)
from support.modelstage_objects import (
    SPEC,
    complete_rollout,
    deploy_path,
    digest_of,
    finish_stage_job,
    job_path,
    md_path,
    merged,
    model_deployment,
    pod_path,
    summary,
    template_digest,
    vllm_deployment,
)
from support.node_cluster import add_node, now
from support.operator_flow import (
    MD,
    condition,
    status_of,
    wait_event,
    wait_job,
    wait_phase,
    wait_rolled,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

ON = {"nodeCache": {"enabled": True}}


@pytest.fixture
def cluster(node_cache_cluster: Cluster) -> Cluster:
    """Node caching's APIs served (Nodes, NodeCaches; the operator's chart role for them)."""
    return node_cache_cluster


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


def content_of(digest: str) -> str:
    """The copy's content address the agent would compute (any 32 hex will do here)."""
    return (digest * 2)[: nc.CONTENT_HEX_CHARS]


async def report(cluster: Cluster, node: str, *held: str, warm: bool = False, ns: str = "") -> None:
    """What ``node``'s agent writes each pass: its NodeCache report, heartbeat now; ``held``
    are the digests whose copies ``ns`` was granted."""
    path = resource_path(nc.API_VERSION, nc.PLURAL, None, node)
    if await cluster.client.get(path) is None:
        await cluster.client.create(
            resource_path(nc.API_VERSION, nc.PLURAL),
            {"apiVersion": nc.API_VERSION, "kind": nc.KIND, "metadata": {"name": node}},
        )
    copies = [
        {"content": content_of(d), "label": nc.content_label(content_of(d)), "bytes": 123456,
         "files": 4, "warm": warm, "grants": [{"namespace": ns, "digest": d}]}
        for d in held
    ]  # fmt: skip
    status = {
        "node": node,
        "root": nc.DEFAULT_ROOT,
        "budgetBytes": 10**12,
        "bytesHeld": 123456 * len(held),
        "heartbeat": now(),
        "endpoint": f"http://10.0.0.1:{nc.DEFAULT_COPY_PORT}",
        "copies": copies,
        "partial": [],
    }
    await cluster.client.patch(
        resource_path(nc.API_VERSION, nc.PLURAL, None, node, "status"), {"status": status}
    )


def copy_summary(digest: str) -> str:
    return json.dumps(
        {
            "content": content_of(digest),
            "digest": digest,
            "bytes": 123456,
            "files": 4,
            "seconds": 0.5,
            "bytesPerSecond": 246912,
            "alreadyComplete": False,
            "node": "n",
        }
    )


async def copy_jobs(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    jobs = await cluster.client.list(
        job_path(ns), labelSelector="app.kubernetes.io/component=node-copy"
    )
    return {j["metadata"]["annotations"][NODE_ANNOTATION]: j for j in jobs}


def gpu(ns: str) -> dict[str, str]:
    """The labels of the test's GPU nodes (its own pool: Nodes are cluster-wide)."""
    return {"gpu": "h100", "pool": ns}


async def apply_gpu_workload(cluster: Cluster, ns: str, spec: dict[str, Any]) -> str:
    """A 2-replica vLLM Deployment on the test's ``gpu=h100`` nodes, tolerating the ``gpu``
    taint, and its ModelDeployment; returns the digest."""
    workload = vllm_deployment(replicas=2, model_deployment=MD)
    pod = workload["spec"]["template"]["spec"]
    pod["nodeSelector"] = gpu(ns)
    pod["tolerations"] = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    await cluster.client.create(deploy_path(ns, None), workload)
    await cluster.client.create(resource_path("modelstage.io/v1alpha1", "modeldeployments", ns),
                                model_deployment(MD, spec))  # fmt: skip
    return digest_of(spec)


async def wait_cache(
    cluster: Cluster, ns: str, what: str, check: Any, timeout: float = 60.0
) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        status = await status_of(cluster, ns)
        cache = status.get("nodeCache") or {}
        return status if cache and check(status, cache) else None

    return await eventually(probe, timeout=timeout, what=what)


async def finish_copy(cluster: Cluster, ns: str, digest: str, node: str) -> None:
    await finish_stage_job(
        cluster.client,
        ns,
        digest,
        message=copy_summary(digest),
        succeeded=True,
        job_name=copy_job_name(digest, node),
        container=COPY_CONTAINER,
    )


async def serving_pod(cluster: Cluster, ns: str, digest: str, node: str, result: str) -> None:
    """A serving pod of ``digest`` on ``node`` whose prepare reported the node cache."""
    name = f"vllm-{node}-{uuid.uuid4().hex[:5]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"app": "vllm"},
            "annotations": {"modelstage.io/artifact-digest": digest},
        },
        "spec": {
            "nodeName": node,
            "initContainers": [{"name": "modelstage-prepare", "image": "x"}],
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}],
        },
    }
    await cluster.client.create(pod_path(ns), pod)
    prepared = json.dumps({"digest": digest, "nodeCache": {"result": result, "path": "/x"}})
    terminated = {
        "exitCode": 0,
        "reason": "Completed",
        "message": prepared,
        "startedAt": "2030-01-01T00:00:01Z",
        "finishedAt": "2030-01-01T00:00:02Z",
    }
    await cluster.client.patch(
        pod_path(ns, name, "status"),
        {
            "status": {
                "phase": "Running",
                "initContainerStatuses": [
                    {
                        "name": "modelstage-prepare",
                        "ready": True,
                        "restartCount": 0,
                        "image": "x",
                        "imageID": "",
                        "state": {"terminated": terminated},
                    }
                ],
            }
        },
    )


async def test_copies_go_to_the_matching_nodes_then_the_workload_rolls_onto_them(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, tag = namespace, namespace[-6:]
    a, b, cpu, tainted, agentless = (
        # The ineligible nodes sort first: the replicas' worth by name would pick them.
        f"{n}-{tag}"
        for n in ("gpu-a", "gpu-b", "a-cpu", "gpu-0-tainted", "gpu-0-agentless")
    )
    await add_node(cluster, a, gpu(ns))
    await add_node(cluster, b, gpu(ns))
    await add_node(cluster, cpu, {"pool": ns})
    await add_node(cluster, tainted, gpu(ns), [{"key": "maint", "effect": "NoSchedule"}])
    await add_node(cluster, agentless, gpu(ns))
    for node in (a, b, cpu, tainted):
        await report(cluster, node)
    spec = merged(SPEC, ON)
    digest = await apply_gpu_workload(cluster, ns, spec)
    await wait_job(cluster, ns, digest)
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)

    status = await wait_cache(cluster, ns, "copying", lambda s, c: c.get("phase") == "Copying")
    assert status["phase"] == "Staged"
    assert status["artifact"]["digest"] == digest
    assert condition(status, "NodeCached")["reason"] == "Copying"
    assert status["nodeCache"]["wanted"] == 2
    jobs = await eventually(
        lambda: _jobs_on(cluster, ns, {a, b}), what="copy Jobs on the two matching nodes"
    )
    assert set(jobs) == {a, b}  # not the CPU node, the tainted one, or the one without an agent
    pod = jobs[a]["spec"]["template"]["spec"]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ] == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [a]}]}]
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    workload = await cluster.client.get(deploy_path(ns))
    assert workload is not None
    annotations = workload["spec"]["template"].get("metadata", {}).get("annotations") or {}
    assert "modelstage.io/artifact-digest" not in annotations  # not rolled while copying

    await finish_copy(cluster, ns, digest, a)
    await report(cluster, a, digest, ns=ns)
    status = await wait_cache(cluster, ns, "one node ready", lambda s, c: c.get("ready") == 1)
    assert status["phase"] == "Staged"
    await finish_copy(cluster, ns, digest, b)
    await report(cluster, b, digest, ns=ns)

    rolled = await wait_rolled(cluster, ns, digest)
    status = await status_of(cluster, ns)
    assert status["nodeCache"]["phase"] == "Ready"
    assert condition(status, "NodeCached")["status"] == "True"
    assert {n["name"]: n["state"] for n in status["nodeCache"]["nodes"]} == {a: "Ready", b: "Ready"}
    template = rolled["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in template["volumes"]}
    content = content_of(digest)
    claim = volume_claim = volumes["modelstage-node-cache"]["persistentVolumeClaim"]
    assert claim == {"claimName": claim_name(content), "readOnly": True}
    assert "hostPath" not in json.dumps(rolled)
    assert nc.CACHE_GID in template["securityContext"]["supplementalGroups"]
    prepare = next(c for c in template["initContainers"] if c["name"] == "modelstage-prepare")
    assert prepare["command"][-2:] == ["--node-cache", nc.POD_MOUNT]
    assert "affinity" not in template  # the PV's node affinity places the pods
    assert template["nodeSelector"] == gpu(ns)  # the user's own placement stays
    pvc = await cluster.client.get(
        resource_path("v1", "persistentvolumeclaims", ns, volume_claim["claimName"])
    )
    assert pvc is not None and pvc["spec"]["volumeName"] == volume_name(ns, content)
    pv = await cluster.client.get(
        resource_path("v1", "persistentvolumes", None, volume_name(ns, content))
    )
    assert pv is not None
    assert pv["spec"]["local"] == {"path": f"{nc.DEFAULT_ROOT}/{content}"}
    assert pv["spec"]["claimRef"]["name"] == volume_claim["claimName"]
    # Each node's NodeCache spec keeps what the ModelDeployment pins.

    async def kept() -> bool:
        body = await cluster.client.get(resource_path(nc.API_VERSION, nc.PLURAL, None, a)) or {}
        keep = (body.get("spec") or {}).get("keep") or []
        return {"namespace": ns, "digest": digest} in keep

    await eventually(kept, what=f"{a}'s spec keeping the artifact")
    await wait_event(cluster, ns, "CopyJobCreated")

    # Pods report hits and misses per node, a node without a copy included.
    await serving_pod(cluster, ns, digest, a, nc.HIT)
    await serving_pod(cluster, ns, digest, cpu, nc.MISS)

    def counted(_: dict[str, Any], cache: dict[str, Any]) -> bool:
        nodes = {n["name"]: n for n in cache.get("nodes") or []}
        return nodes.get(a, {}).get("hits") == 1 and nodes.get(cpu, {}).get("misses") == 1

    await wait_cache(cluster, ns, "hits and misses", counted)
    metrics = await operator.scrape()
    assert 'modelstage_node_cache_pod_starts_total{result="hit"} 1.0' in metrics
    assert 'modelstage_node_cache_pod_starts_total{result="miss"} 1.0' in metrics
    assert (
        f'modelstage_node_cache_nodes{{model_deployment="{MD}",namespace="{ns}",state="Ready"}} 2.0'
        in metrics
    )

    # A node that loses its copy (wiped, evicted) shows in the status.
    await report(cluster, b)

    def lost(_: dict[str, Any], cache: dict[str, Any]) -> bool:
        nodes = {n["name"]: n for n in cache.get("nodes") or []}
        return nodes.get(b, {}).get("state") == "Failed"

    status = await wait_cache(cluster, ns, f"{b} without its copy", lost)
    node_b = next(n for n in status["nodeCache"]["nodes"] if n["name"] == b)
    assert "no longer holds" in node_b["message"]
    assert status["nodeCache"]["ready"] == 1
    assert condition(status, "NodeCached")["reason"] == "CopyLost"

    # The claim goes (here by hand; with the ModelDeployment, by the garbage collector): its
    # PV, which names a copy on the nodes, is deleted by the operator.
    await claim_gone(cluster, ns, claim_name(content), volume_name(ns, content))


async def claim_gone(cluster: Cluster, ns: str, claim: str, volume: str) -> None:
    pvc_path = resource_path("v1", "persistentvolumeclaims", ns, claim)
    pv_path = resource_path("v1", "persistentvolumes", None, volume)
    pvc = await cluster.client.get(pvc_path)
    assert pvc is not None
    if cluster.tier == "real":

        async def bound() -> bool:
            body = await cluster.client.get(pvc_path) or {}
            return (body.get("status") or {}).get("phase") == "Bound"

        await eventually(bound, what="the claim bound by the PV controller")
    else:  # the PV controller's part: the bound claim's uid in the PV
        await cluster.client.patch(pv_path, {"spec": {"claimRef": {"uid": pvc["metadata"]["uid"]}}})
    await cluster.client.delete(pvc_path)
    if cluster.tier != "real":  # the PV controller marks a PV whose claim is gone
        await cluster.client.patch(
            resource_path("v1", "persistentvolumes", None, volume, "status"),
            {"status": {"phase": "Released"}},
        )

    async def deleted() -> bool:
        return await cluster.client.get(pv_path) is None

    await eventually(deleted, what=f"PersistentVolume {volume} deleted once its claim is gone")


async def _jobs_on(cluster: Cluster, ns: str, nodes: set[str]) -> dict[str, dict[str, Any]] | None:
    jobs = await copy_jobs(cluster, ns)
    return jobs if set(jobs) >= nodes else None


async def test_the_deadline_rolls_anyway_and_says_so(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, tag = namespace, namespace[-6:]
    a = f"gpu-a-{tag}"
    await add_node(cluster, a, gpu(ns))
    await report(cluster, a)
    spec = merged(SPEC, {"nodeCache": {"enabled": True, "deadlineSeconds": 1}})
    digest = await apply_gpu_workload(cluster, ns, spec)
    await wait_job(cluster, ns, digest)
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)
    await wait_cache(cluster, ns, "copying", lambda s, c: c.get("phase") == "Copying")
    assert await copy_jobs(cluster, ns)

    async def agent_pass_until_rolled() -> dict[str, Any] | None:
        # The agent's next pass (a heartbeat) wakes the waiting ModelDeployment.
        await report(cluster, a)
        workload = await cluster.client.get(deploy_path(ns))
        return workload if template_digest(workload) == digest else None

    rolled = await eventually(agent_pass_until_rolled, interval=0.5, what="the roll anyway")
    status = await status_of(cluster, ns)
    assert status["nodeCache"]["phase"] == "DeadlinePassed"
    cached = condition(status, "NodeCached")
    assert (cached["status"], cached["reason"]) == ("False", "DeadlinePassed")
    assert "0/1 nodes hold" in cached["message"]
    # No node holds a copy: the roll goes without the node-cache volume.
    assert "modelstage-node-cache" not in {
        v["name"] for v in rolled["spec"]["template"]["spec"].get("volumes") or []
    }
    await wait_event(cluster, ns, "DeadlinePassed", "Warning")


async def test_without_node_caching_nothing_of_it_appears_until_it_is_turned_on(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, tag = namespace, namespace[-6:]
    a = f"gpu-a-{tag}"
    await add_node(cluster, a, gpu(ns))
    await report(cluster, a)
    digest = await apply_gpu_workload(cluster, ns, copy.deepcopy(SPEC))
    await wait_job(cluster, ns, digest)
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)
    rolled = await wait_rolled(cluster, ns, digest)
    status = await status_of(cluster, ns)
    assert "nodeCache" not in status and not condition(status, "NodeCached")
    assert "affinity" not in rolled["spec"]["template"]["spec"]
    assert not await copy_jobs(cluster, ns)
    await complete_rollout(cluster.client, ns)
    await wait_phase(cluster, ns, "Ready")

    # Turned on for the artifact it serves: copied, then the template is patched (same digest).
    await cluster.client.patch(md_path(ns, MD), {"spec": ON})
    await eventually(lambda: _jobs_on(cluster, ns, {a}), what="the copy Job")
    await finish_copy(cluster, ns, digest, a)
    await report(cluster, a, digest, ns=ns)

    async def patched() -> dict[str, Any] | None:
        workload = await cluster.client.get(deploy_path(ns)) or {}
        volumes = workload["spec"]["template"]["spec"].get("volumes") or []
        return workload if any(v["name"] == "modelstage-node-cache" for v in volumes) else None

    workload = await eventually(patched, what="the node cache in the template")
    assert template_digest(workload) == digest
