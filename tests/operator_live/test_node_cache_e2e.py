"""Node caching end to end (tier: kmock, or the real control plane when ``KUBEBUILDER_ASSETS``
is set): nothing here is played but the kubelet. The operator resolves a real source, stages
it, has it copied onto the nodes the workload may run on and rolls; every Job runs for real as
a local process (``support.mini_kubelet``), one node agent per simulated node (a real
``modelstage agent`` process with its own root) reports what its node holds and labels it.

Proves: copies land only on the nodes the workload's nodeSelector admits, each byte-equal to
the staged artifact; the agents label exactly those nodes and report them; the roll waits for
the copies and for the agents to read them into the page cache (``warm``; the deadline is far
away), and patches the node-local path and the node affinity; a new spec stages and copies
a new artifact while the old one, kept for rollback, is never evicted under a tight budget.
"""

from __future__ import annotations

import filecmp
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from modelstage.core.node_cache import API_VERSION, DEFAULT_ROOT, PLURAL, node_label
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.operator.kube_client import resource_path
from support.kube_cluster import Cluster, eventually
from support.mini_kubelet import MiniKubelet
from support.modelstage_objects import (
    complete_rollout,
    deploy_path,
    md_path,
    model_deployment,
    vllm_deployment,
)
from support.node_agent import AgentProcess, agent_kubeconfig
from support.node_cluster import add_node
from support.operator_flow import MD, status_of, wait_phase
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]
BIN = Path(sys.executable).parent
NODES = {"gpu-a": {"gpu": "true"}, "gpu-b": {"gpu": "true"}, "cpu-c": {}}
BUDGET = 5 * 2**20
"""Each artifact here is 3.2 MB: a node's budget holds one copy, not two."""
SPEC: dict[str, Any] = {
    "model": {"uri": "pvc://models/tiny"},
    "parallelism": {"tensor": 2},
    "loadFormat": "sharded_state",
    "storage": {"pvc": {"claimName": "artifacts", "path": "/staged"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": "vllm"}, "containerName": "vllm"},
    "nodeCache": {"enabled": True, "nodes": "Replicas", "warm": True},
}


@pytest.fixture
def cluster(node_cache_cluster: Cluster) -> Cluster:
    return node_cache_cluster


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
    operator: OperatorProcess,
    world: tuple[Path, dict[str, Path]],
    tmp_path: Path,
) -> AsyncIterator[tuple[MiniKubelet, list[AgentProcess]]]:
    """The Nodes, an agent per node (under the chart's agent role on the real tier) and the
    kubelet that runs every Job of the namespace."""
    claims, roots = world
    for name, labels in NODES.items():
        await add_node(cluster, name, labels)
    kubeconfig = await agent_kubeconfig(cluster, tmp_path / "agent.kubeconfig")
    agents = [
        AgentProcess(name, root, BUDGET, kubeconfig, tmp_path / f"{name}.log", interval=0.5).start()
        for name, root in roots.items()
    ]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    try:
        async with MiniKubelet(cluster, namespace, claims, roots, scratch) as kubelet:
            yield kubelet, agents
    finally:
        for agent in agents:
            await agent.stop()


def workload() -> dict[str, Any]:
    """Two replicas that may run only on the GPU nodes."""
    deployment = vllm_deployment(replicas=2, model_deployment=MD)
    deployment["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "true"}
    return deployment


async def node_labels(cluster: Cluster, name: str) -> dict[str, str]:
    body = await cluster.client.get(resource_path("v1", "nodes", None, name)) or {}
    return dict(body.get("metadata", {}).get("labels") or {})


async def report(cluster: Cluster, name: str) -> dict[str, Any]:
    body = await cluster.client.get(resource_path(API_VERSION, PLURAL, None, name)) or {}
    return dict(body.get("status") or {})


async def held(cluster: Cluster, name: str) -> set[str]:
    return {a["digest"] for a in (await report(cluster, name)).get("artifacts") or []}


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
    """The Deployment controller's part: every replica on the new template."""
    await complete_rollout(cluster.client, ns)
    await wait_phase(cluster, ns, "Ready", timeout=60)


def same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


async def test_staged_copied_to_the_matching_nodes_then_rolled_and_kept_for_rollback(
    cluster: Cluster,
    namespace: str,
    running: tuple[MiniKubelet, list[AgentProcess]],
    world: tuple[Path, dict[str, Path]],
) -> None:
    kubelet, agents = running
    claims, roots = world
    gpus = ("gpu-a", "gpu-b")
    await cluster.client.create(deploy_path(namespace, None), workload())
    await cluster.client.create(md_path(namespace), model_deployment(MD, SPEC))

    first = await rolled(cluster, namespace)
    status = await status_of(cluster, namespace)
    assert status["nodeCache"]["phase"] == "Ready", status["nodeCache"]
    assert sorted(n["name"] for n in status["nodeCache"]["nodes"]) == list(gpus)
    staged = next(claims.glob(f"artifacts/staged/**/{first}"))
    for name in gpus:  # every byte as staged, the node labelled, the copy reported
        assert same_tree(staged, roots[name] / first), name
        assert (await node_labels(cluster, name)).get(node_label(first)) == "true"
        assert first in await held(cluster, name)
    for agent in agents:  # read into the page cache before the roll, on the GPU nodes only
        assert (f"warmed {first}" in agent.log.read_text()) == (agent.node in gpus), agent.node
    assert not any(roots["cpu-c"].iterdir()), "the CPU node got a copy"
    assert node_label(first) not in await node_labels(cluster, "cpu-c")
    assert sorted(r["node"] for r in kubelet.ran if r["node"]) == list(gpus), kubelet.ran
    assert all(r["rc"] == 0 for r in kubelet.ran), kubelet.ran

    pod = (await cluster.client.get(deploy_path(namespace)) or {})["spec"]["template"]["spec"]
    (cache,) = [v for v in pod["volumes"] if "hostPath" in v]
    assert cache["hostPath"] == {"path": DEFAULT_ROOT, "type": "DirectoryOrCreate"}
    preferred = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [e["key"] for t in preferred for e in t["preference"]["matchExpressions"]] == [
        node_label(first)
    ]
    assert pod["nodeSelector"] == {"gpu": "true"}  # the user's own placement is kept
    await settle(cluster, namespace)

    # A new artifact: staged and copied while the first one serves; then rolled. The first one
    # is the rollback target: pinned, so kept although the budget holds one copy only.
    await cluster.client.patch(md_path(namespace, MD), {"spec": {"dtype": "float16"}})
    second = await rolled(cluster, namespace, first)
    for name in gpus:
        assert {first, second} <= await held(cluster, name), name
        assert (roots[name] / first / "modelstage.json").exists(), "evicted the rollback target"
        assert (await report(cluster, name))["message"].startswith("over budget"), name
    await settle(cluster, namespace)

    # A third: the first is now neither served, nor the rollback target, nor among the two
    # artifacts retention keeps: over the budget, it is evicted, and its label goes with it.
    await cluster.client.patch(md_path(namespace, MD), {"spec": {"parallelism": {"tensor": 1}}})
    third = await rolled(cluster, namespace, second)

    async def evicted() -> bool:
        for name in gpus:
            if first in await held(cluster, name) or (roots[name] / first).exists():
                return False
            if node_label(first) in await node_labels(cluster, name):
                return False
        return True

    await eventually(evicted, timeout=60, what="the first artifact evicted from the GPU nodes")
    for name in gpus:
        assert {second, third} <= await held(cluster, name), name
        assert (await node_labels(cluster, name)).get(node_label(third)) == "true"
