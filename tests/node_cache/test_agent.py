"""``modelstage agent`` as a local process per simulated node (a temp root, a node name)
against the tests' API server (kmock, or the real one with ``KUBEBUILDER_ASSETS``; there the
agent holds only its least-privilege RBAC): it reports what the root holds, labels its own
node and no other, evicts least recently used copies under its budget but never a pinned one,
warms on request, recovers a partial copy after restarts, and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from modelstage.agent.locks import digest_lock
from modelstage.core import node_cache
from modelstage.core.node_cache import LABEL_PREFIX, node_label
from modelstage.operator.kube_client import resource_path
from support.killer import kill_after_writing
from support.kube_cluster import Cluster, eventually, free_port, new_namespace, write_kubeconfig
from support.modelstage_objects import SPEC, md_path, model_deployment
from support.node_agent import AgentProcess, agent_kubeconfig, digest_of, fake_digest, make_copy

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]
A, B, C, D, E, F = (fake_digest(i) for i in range(1, 7))
SIZE = 100_000
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def node_path(name: str) -> str:
    return resource_path("v1", "nodes", name=name)


def cache_path(name: str) -> str:
    return resource_path(node_cache.API_VERSION, node_cache.PLURAL, name=name)


async def new_node(cluster: Cluster, labels: dict[str, str]) -> str:
    name = f"node-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
    await cluster.client.create("/api/v1/nodes", body)
    return name


async def report(cluster: Cluster, node: str) -> dict[str, Any]:
    obj = await cluster.client.get(cache_path(node)) or {}
    status: dict[str, Any] = obj.get("status") or {}
    return status


async def labels(cluster: Cluster, node: str) -> dict[str, str]:
    obj = await cluster.client.get(node_path(node)) or {}
    found: dict[str, str] = obj["metadata"].get("labels") or {}
    return found


def metric(text: str, name: str, node: str) -> float:
    """One sample of the agent's metrics."""
    match = re.search(rf'^{name}{{node="{node}"}} (\S+)$', text, re.MULTILINE)
    assert match, f"no {name} for {node} in:\n{text}"
    return float(match.group(1))


def held(status: dict[str, Any]) -> list[str]:
    return sorted(a["digest"] for a in status.get("artifacts") or [])


async def pin(cluster: Cluster, status: dict[str, Any]) -> str:
    """A ModelDeployment whose status pins (or asks to warm) some digests; its status path."""
    ns = await new_namespace(cluster, f"t-{uuid.uuid4().hex[:8]}")
    name = "llama"
    await cluster.client.create(md_path(ns), model_deployment(name, SPEC))
    await cluster.client.patch(md_path(ns, name, "status"), {"status": status})
    return md_path(ns, name, "status")


def artifact_status(digest: str) -> dict[str, Any]:
    return {"digest": digest, "uri": f"pvc://models/artifacts/t/{digest}",
            "format": "sharded_state", "tensorParallelSize": 1}  # fmt: skip


async def start_agent(
    cluster: Cluster, tmp_path: Path, node: str, root: Path, budget: int, **kw: Any
) -> AgentProcess:
    kubeconfig = await agent_kubeconfig(cluster, tmp_path / "agent-kubeconfig")
    return AgentProcess(node, root, budget, kubeconfig, tmp_path / f"agent-{node}.log", **kw).start()


async def test_reports_held_copies_labels_its_node_and_no_other(
    cluster: Cluster, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    make_copy(root, A, SIZE, last_used=T0)
    make_copy(root, B, 1000, partial=True)
    (root / "not-ours").write_text("left alone")
    mine = await new_node(cluster, {"team": "a", node_label(F): "true"})
    other_labels = {"team": "b", node_label(A): "true", node_label(C): "true"}
    other = await new_node(cluster, other_labels)
    agent = await start_agent(cluster, tmp_path, mine, root, 10 * SIZE,
                              metrics_port=free_port())  # fmt: skip
    try:
        first = await eventually(lambda: report(cluster, mine), what="the NodeCache report")
        assert first["node"] == mine and first["root"] == str(root)
        assert first["budgetBytes"] == 10 * SIZE and first["bytesHeld"] == SIZE + 1000
        assert held(first) == [A] and first["artifacts"][0]["bytes"] == SIZE
        assert first["artifacts"][0]["files"] == 1 and first["artifacts"][0]["pinned"] is False
        assert first["partial"] == [{"digest": B, "bytes": 1000, "copying": False}]
        assert first["copyBytesPerSecond"] == SIZE / 2.0

        async def relabelled() -> bool:
            return await labels(cluster, mine) == {"team": "a", node_label(A): "true"}

        await eventually(relabelled, what="its node labelled with what it holds")

        async def next_heartbeat() -> bool:
            return (await report(cluster, mine))["heartbeat"] != first["heartbeat"]

        await eventually(next_heartbeat, what="a second pass")
        assert await labels(cluster, other) == other_labels
        assert await cluster.client.get(cache_path(other)) is None
        node = await cluster.client.get(node_path(mine))
        owner = (await cluster.client.get(cache_path(mine)) or {})["metadata"]["ownerReferences"]
        assert owner == [{"apiVersion": "v1", "kind": "Node", "name": mine,
                          "uid": node["metadata"]["uid"]}]  # fmt: skip
        metrics = agent.metrics()
        assert metric(metrics, "modelstage_node_cache_bytes_held", mine) == SIZE + 1000
        assert metric(metrics, "modelstage_node_cache_artifacts", mine) == 1
        assert metric(metrics, "modelstage_node_cache_budget_bytes", mine) == 10 * SIZE
        assert metric(metrics, "modelstage_node_cache_copy_bytes_per_second", mine) == SIZE / 2
        assert (root / "not-ours").read_text() == "left alone"
        assert node_cache.partial_dir(root, B).is_dir()  # under budget: kept for a resume
    finally:
        assert await agent.stop() == 0
    assert "Traceback" not in agent.log.read_text()


async def test_evicts_least_recently_used_under_the_budget_never_a_pinned_copy(
    cluster: Cluster, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    make_copy(root, A, SIZE, last_used=T0 + timedelta(hours=1))
    make_copy(root, B, SIZE, last_used=T0 + timedelta(hours=2))
    make_copy(root, C, SIZE, last_used=T0)  # the oldest: served
    make_copy(root, D, SIZE)  # never used: the rollback target
    make_copy(root, E, SIZE)  # never used: being rolled out
    await pin(cluster, {"artifact": artifact_status(C), "previousArtifact": artifact_status(D),
                        "desiredDigest": E})  # fmt: skip
    node = await new_node(cluster, {node_label(A): "true", node_label(B): "true"})
    agent = await start_agent(cluster, tmp_path, node, root, 4 * SIZE, metrics_port=free_port())
    try:

        async def evicted_one() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if status.get("evictions") == 1 else None

        status = await eventually(evicted_one, what="one eviction")
        assert held(status) == [B, C, D, E]
        pinned = {a["digest"]: a["pinned"] for a in status["artifacts"]}
        assert pinned == {B: False, C: True, D: True, E: True}
        assert not node_cache.copy_dir(root, A).exists()
        assert not node_cache.state_file(root, A).exists()
        last_used = {a["digest"]: a.get("lastUsed") for a in status["artifacts"]}
        assert datetime.fromisoformat(last_used[C]) > T0  # a pinned copy's use is recorded
        assert metric(agent.metrics(), "modelstage_node_cache_evictions_total", node) == 1

        async def unlabelled() -> bool:
            return node_label(A) not in await labels(cluster, node)

        await eventually(unlabelled, what="the evicted copy's label removed")
    finally:
        assert await agent.stop() == 0
    agent = await start_agent(cluster, tmp_path, node, root, 1)  # restarted, a tiny budget
    try:

        async def all_pinned() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if held(status) == [C, D, E] and status.get("message") else None

        status = await eventually(all_pinned, what="everything unpinned evicted")
        assert re.search(r"over budget: 300000 bytes held, budget 1; everything left is pinned",
                         status["message"])  # fmt: skip
        for digest in (C, D, E):
            assert (node_cache.copy_dir(root, digest) / "model.safetensors").stat().st_size == SIZE
    finally:
        assert await agent.stop() == 0


async def test_warms_a_copy_a_model_deployment_asks_for_as_soon_as_it_asks(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The request arrives long before the next pass is due (an hour): the agent's watch of
    ModelDeployments starts one at once. SIGTERM ends the hour's wait too."""
    root = tmp_path / "root"
    make_copy(root, A, SIZE)
    make_copy(root, B, SIZE)
    node = await new_node(cluster, {})
    agent = await start_agent(cluster, tmp_path, node, root, 10 * SIZE, metrics_port=free_port(),
                              interval=3600)  # fmt: skip
    try:
        first = await eventually(lambda: report(cluster, node), what="the first report")
        assert not any(a["warm"] for a in first["artifacts"])
        asking = await pin(cluster, {"artifact": artifact_status(A), "nodeCache": {
            "digest": A, "phase": "Warming", "wanted": 1, "ready": 1,
            "nodes": [{"name": node, "state": "Ready"}]}})  # fmt: skip
        await pin(cluster, {"artifact": artifact_status(B), "nodeCache": {
            "digest": B, "phase": "Warming", "nodes": [{"name": "elsewhere", "state": "Ready"}]}})  # fmt: skip

        async def warm() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if any(a.get("warm") for a in status.get("artifacts") or []) else None

        status = await eventually(warm, what="the copy warmed")
        by_digest = {a["digest"]: a for a in status["artifacts"]}
        assert by_digest[A]["warm"] is True and by_digest[A]["warmedAt"]
        assert by_digest[B]["warm"] is False and "warmedAt" not in by_digest[B]
        assert metric(agent.metrics(), "modelstage_node_cache_warm_seconds_count", node) == 1

        async def cold() -> bool:
            return not any(a["warm"] for a in (await report(cluster, node))["artifacts"])

        # The roll went on (Ready): the request ended; a later one reads the copy again.
        await cluster.client.patch(asking, {"status": {"nodeCache": {"phase": "Ready"}}})
        await eventually(cold, what="the ended request forgotten")
        await cluster.client.patch(asking, {"status": {"nodeCache": {"phase": "Warming"}}})
        await eventually(warm, what="the copy warmed again")
        assert metric(agent.metrics(), "modelstage_node_cache_warm_seconds_count", node) == 2
    finally:
        assert await agent.stop() == 0


async def test_a_copy_being_written_is_reported_and_never_removed(
    cluster: Cluster, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    make_copy(root, A, SIZE, partial=True)
    make_copy(root, B, SIZE, partial=True)
    node = await new_node(cluster, {})
    with digest_lock(node_cache.lock_file(root, A)):  # a copier at work on A
        agent = await start_agent(cluster, tmp_path, node, root, 1)
        try:

            async def dropped() -> dict[str, Any] | None:
                status = await report(cluster, node)
                return status if [p["digest"] for p in status.get("partial", [])] == [A] else None

            status = await eventually(dropped, what="the abandoned partial removed")
            assert status["partial"] == [{"digest": A, "bytes": SIZE, "copying": True}]
            assert A in status["message"] and "over budget" in status["message"]
            assert node_cache.partial_dir(root, A).is_dir()
            assert not node_cache.partial_dir(root, B).exists()
        finally:
            assert await agent.stop() == 0


async def test_recovers_a_partial_copy_after_restarts(
    cluster: Cluster, tmp_path: Path, artifact: Path
) -> None:
    """The copier is killed mid-copy and the agent restarted (SIGKILL): the partial copy is
    reported and kept, a retried copy resumes it, and the agent reports and labels the copy."""
    root, digest = tmp_path / "root", digest_of(artifact)
    total = sum(p.stat().st_size for p in artifact.iterdir())
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    copy = [sys.executable, "-m", "modelstage.stager.cli", "node-copy", "--artifact",
            str(artifact), "--digest", digest, "--root", str(root)]  # fmt: skip
    for attempt in range(5):
        kill = kill_after_writing(copy, total // 2, env=env, log=tmp_path / f"copy{attempt}.log")
        if kill.written >= 0:
            break
        node_cache.copy_dir(root, digest).rename(tmp_path / f"done{attempt}")
    else:
        pytest.fail("the copy finished before every kill point")
    node = await new_node(cluster, {})
    agent = await start_agent(cluster, tmp_path, node, root, 10 * total)
    try:

        async def partial() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if status.get("partial") else None

        status = await eventually(partial, what="the partial copy reported")
        assert status["partial"][0]["digest"] == digest and status["partial"][0]["copying"] is False
        assert held(status) == []
    finally:
        assert await agent.stop(signal.SIGKILL) == -signal.SIGKILL
    agent = await start_agent(cluster, tmp_path, node, root, 10 * total)
    try:
        done = await asyncio.to_thread(
            subprocess.run, copy, env=env, capture_output=True, text=True, timeout=120, cwd="/"
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["resumedFiles"] >= 1

        async def complete() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if held(status) == [digest] and not status.get("partial") else None

        status = await eventually(complete, what="the resumed copy reported")
        assert status["artifacts"][0]["bytes"] == json.loads(
            (artifact / "modelstage.json").read_text())["bytes"]  # fmt: skip

        async def labelled() -> bool:
            return (await labels(cluster, node)).get(node_label(digest)) == "true"

        await eventually(labelled, what="the node labelled")
        assert all(not k.startswith(LABEL_PREFIX) or k == node_label(digest)
                   for k in await labels(cluster, node))  # fmt: skip
    finally:
        assert await agent.stop() == 0


async def test_a_root_it_cannot_read_is_reported_and_a_bad_one_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    make_copy(root, A, SIZE)
    node = await new_node(cluster, {})
    agent = await start_agent(cluster, tmp_path, node, root, 10 * SIZE)
    try:
        await eventually(lambda: report(cluster, node), what="the first report")
        root.rename(tmp_path / "away")

        async def complaint() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if "cannot read the root" in status.get("message", "") else None

        status = await eventually(complaint, what="the unreadable root reported")
        assert str(root) in status["message"] and held(status) == []
        (tmp_path / "away").rename(root)

        async def back() -> bool:
            return held(await report(cluster, node)) == [A]

        await eventually(back, what="the root read again")
    finally:
        assert await agent.stop() == 0
    (tmp_path / "file").write_text("")
    refused = subprocess.run(
        [sys.executable, "-m", "modelstage.stager.cli", "agent", "--node", node, "--root",
         str(tmp_path / "file" / "root"), "--budget", "1Gi"],
        env={**os.environ, "PYTHONSAFEPATH": "1"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1].startswith(f"error: --root {tmp_path}/file/root")


async def test_evicts_nothing_while_it_cannot_know_what_is_in_use(tmp_path: Path) -> None:
    """No API server to list the ModelDeployments from: over budget, yet every copy stays."""
    root = tmp_path / "root"
    make_copy(root, A, SIZE)
    make_copy(root, B, SIZE, partial=True)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{free_port()}")
    agent = AgentProcess("n1", root, 1, kubeconfig, tmp_path / "agent.log").start()
    try:

        async def passes() -> bool:
            return agent.log.read_text().count("cannot list ModelDeployments") >= 2

        await eventually(passes, what="two passes without the API server")
    finally:
        assert await agent.stop() == 0
    assert (node_cache.copy_dir(root, A) / "modelstage.json").exists()
    assert node_cache.partial_dir(root, B).is_dir()
