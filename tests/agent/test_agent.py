"""``modelstage agent`` as a local process per simulated node (a temp root, a node name)
against the tests' API server (kmock, or the real one with ``KUBEBUILDER_ASSETS``; there the
agent holds only its least-privilege RBAC): it reports what the root holds, labels its own
node (opaque labels) and no other, keeps what its NodeCache's spec names and evicts least
recently used copies under its budget, warms on request as soon as the spec asks, keeps a
partial copy across restarts, and stops on SIGTERM."""

from __future__ import annotations

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
from modelstage.api.kube_client import resource_path
from modelstage.core import node_cache
from modelstage.core.node_cache import content_label
from support.kube_cluster import Cluster, eventually, free_port, write_kubeconfig
from support.node_agent import AgentProcess, agent_kubeconfig, fake_digest, make_copy

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]
NS = "ns"
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
    return sorted(c["content"] for c in status.get("copies") or [])


def pairs(*seeds: int) -> list[dict[str, str]]:
    """The (namespace, digest) pairs ``make_copy`` grants the copies of ``seeds``."""
    return [{"namespace": NS, "digest": fake_digest(i)} for i in seeds]


async def set_spec(cluster: Cluster, node: str, spec: dict[str, Any]) -> None:
    """What the operator does: the node's NodeCache spec (the object created when missing)."""
    if await cluster.client.get(cache_path(node)) is None:
        body = {"apiVersion": node_cache.API_VERSION, "kind": node_cache.KIND,
                "metadata": {"name": node}, "spec": spec}  # fmt: skip
        await cluster.client.create(resource_path(node_cache.API_VERSION, node_cache.PLURAL), body)
    else:
        await cluster.client.patch(cache_path(node), {"spec": spec})


async def start_agent(
    cluster: Cluster, tmp_path: Path, node: str, root: Path, budget: int, **kw: Any
) -> AgentProcess:
    kubeconfig = await agent_kubeconfig(cluster, tmp_path / "agent-kubeconfig")
    return AgentProcess(node, root, budget, kubeconfig, tmp_path / f"agent-{node}.log", **kw).start()


async def test_reports_held_copies_labels_its_node_and_no_other(
    cluster: Cluster, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    a = make_copy(root, 1, SIZE, last_used=T0)
    b = make_copy(root, 2, 1000, partial=True)
    (root / "not-ours").write_text("left alone")
    stale, foreign = content_label("ff" * 16), content_label("cc" * 16)
    mine = await new_node(cluster, {"team": "a", stale: "true"})
    other_labels = {"team": "b", content_label(a): "true", foreign: "true"}
    other = await new_node(cluster, other_labels)
    agent = await start_agent(cluster, tmp_path, mine, root, 10 * SIZE,
                              metrics_port=free_port())  # fmt: skip
    try:
        first = await eventually(lambda: report(cluster, mine), what="the NodeCache report")
        manifest = (node_cache.copy_dir(root, a) / "modelstage.json").stat().st_size
        assert first["node"] == mine and first["root"] == str(root)
        assert first["budgetBytes"] == 10 * SIZE
        assert first["bytesHeld"] == SIZE + manifest + 1000 and first["freeBytes"] > 0
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", first["endpoint"])
        assert held(first) == [a] and first["copies"][0]["bytes"] == SIZE + manifest
        assert first["copies"][0]["files"] == 1 and first["copies"][0]["pinned"] is False
        assert first["copies"][0]["grants"] == pairs(1)
        assert first["copies"][0]["label"] == content_label(a)
        assert first["partial"] == [{"content": b, "bytes": 1000, "copying": False}]
        assert first["copyBytesPerSecond"] == (SIZE + manifest) / 2.0

        async def relabelled() -> bool:
            return await labels(cluster, mine) == {"team": "a", content_label(a): "true"}

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
        assert metric(metrics, "modelstage_node_cache_bytes_held", mine) == first["bytesHeld"]
        assert metric(metrics, "modelstage_node_cache_artifacts", mine) == 1
        assert metric(metrics, "modelstage_node_cache_budget_bytes", mine) == 10 * SIZE
        assert (root / "not-ours").read_text() == "left alone"
        assert node_cache.partial_dir(root, b).is_dir()  # under budget: kept for a resume
    finally:
        assert await agent.stop() == 0
    assert "Traceback" not in agent.log.read_text()


async def test_keeps_what_its_spec_names_and_evicts_least_recently_used_under_the_budget(
    cluster: Cluster, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    a = make_copy(root, 1, SIZE, last_used=T0 + timedelta(hours=1))
    b = make_copy(root, 2, SIZE, last_used=T0 + timedelta(hours=2))
    c = make_copy(root, 3, SIZE, last_used=T0)  # the oldest: served
    d = make_copy(root, 4, SIZE)  # never used: the rollback target
    e = make_copy(root, 5, SIZE)  # never used: being rolled out
    node = await new_node(cluster, {content_label(a): "true", content_label(b): "true"})
    await set_spec(cluster, node, {"keep": pairs(3, 4, 5)})
    agent = await start_agent(cluster, tmp_path, node, root, 4 * SIZE + 4000,
                              metrics_port=free_port())  # fmt: skip
    try:

        async def evicted_one() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if status.get("evictions") == 1 else None

        status = await eventually(evicted_one, what="one eviction")
        assert held(status) == sorted([b, c, d, e])
        pinned = {x["content"]: x["pinned"] for x in status["copies"]}
        assert pinned == {b: False, c: True, d: True, e: True}
        assert not node_cache.copy_dir(root, a).exists()
        assert not node_cache.state_file(root, a).exists()
        last_used = {x["content"]: x.get("lastUsed") for x in status["copies"]}
        assert datetime.fromisoformat(last_used[c]) > T0  # a kept copy's use is recorded
        assert metric(agent.metrics(), "modelstage_node_cache_evictions_total", node) == 1

        async def unlabelled() -> bool:
            return content_label(a) not in await labels(cluster, node)

        await eventually(unlabelled, what="the evicted copy's label removed")
    finally:
        assert await agent.stop() == 0
    agent = await start_agent(cluster, tmp_path, node, root, 1)  # restarted, a tiny budget
    try:

        async def all_pinned() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if held(status) == sorted([c, d, e]) and status.get("message") else None

        status = await eventually(all_pinned, what="everything unkept evicted")
        assert re.search(r"over budget: \d+ bytes held, budget 1; everything left is kept by "
                         "the NodeCache's spec", status["message"])  # fmt: skip
        for content in (c, d, e):
            assert (node_cache.copy_dir(root, content) / "model.safetensors").stat().st_size == SIZE
    finally:
        assert await agent.stop() == 0


async def test_warms_a_copy_its_spec_asks_for_as_soon_as_it_asks(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The request arrives long before the next pass is due (an hour): the agent's watch of
    its NodeCache starts one at once. SIGTERM ends the hour's wait too."""
    root = tmp_path / "root"
    a = make_copy(root, 1, SIZE)
    b = make_copy(root, 2, SIZE)
    node = await new_node(cluster, {})
    agent = await start_agent(cluster, tmp_path, node, root, 10 * SIZE, metrics_port=free_port(),
                              interval=3600)  # fmt: skip
    try:
        first = await eventually(lambda: report(cluster, node), what="the first report")
        assert not any(x["warm"] for x in first["copies"])
        await set_spec(cluster, node, {"warm": pairs(1)})

        async def warm() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if any(x.get("warm") for x in status.get("copies") or []) else None

        status = await eventually(warm, what="the copy warmed")
        by_content = {x["content"]: x for x in status["copies"]}
        assert by_content[a]["warm"] is True and by_content[a]["warmedAt"]
        assert by_content[b]["warm"] is False and "warmedAt" not in by_content[b]
        assert metric(agent.metrics(), "modelstage_node_cache_warm_seconds_count", node) == 1

        async def cold() -> bool:
            return not any(x["warm"] for x in (await report(cluster, node))["copies"])

        # The roll went on: the request ended; a later one reads the copy again.
        await set_spec(cluster, node, {"warm": []})
        await eventually(cold, what="the ended request forgotten")
        await set_spec(cluster, node, {"warm": pairs(1)})
        await eventually(warm, what="the copy warmed again")
        assert metric(agent.metrics(), "modelstage_node_cache_warm_seconds_count", node) == 2
    finally:
        assert await agent.stop() == 0


async def test_a_copy_being_written_is_reported_and_never_removed(
    cluster: Cluster, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    a = make_copy(root, 1, SIZE, partial=True)
    b = make_copy(root, 2, SIZE, partial=True)
    node = await new_node(cluster, {})
    await set_spec(cluster, node, {})
    with digest_lock(node_cache.lock_file(root, a)):  # a file of ``a`` being received
        agent = await start_agent(cluster, tmp_path, node, root, 1)
        try:

            async def dropped() -> dict[str, Any] | None:
                status = await report(cluster, node)
                return status if [p["content"] for p in status.get("partial", [])] == [a] else None

            status = await eventually(dropped, what="the abandoned partial removed")
            assert status["partial"] == [{"content": a, "bytes": SIZE, "copying": True}]
            assert a in status["message"] and "over budget" in status["message"]
            assert node_cache.partial_dir(root, a).is_dir()
            assert not node_cache.partial_dir(root, b).exists()
        finally:
            assert await agent.stop() == 0


async def test_keeps_a_partial_copy_across_restarts(cluster: Cluster, tmp_path: Path) -> None:
    """The agent is killed (SIGKILL) while a copy is half received: restarted, it reports the
    partial copy and keeps it under the budget, for the next copy Job to resume."""
    root = tmp_path / "root"
    partial = make_copy(root, 1, SIZE, partial=True)
    node = await new_node(cluster, {})
    await set_spec(cluster, node, {})
    agent = await start_agent(cluster, tmp_path, node, root, 10 * SIZE)
    try:
        first = await eventually(lambda: report(cluster, node), what="the first report")
    finally:
        assert await agent.stop(signal.SIGKILL) == -signal.SIGKILL
    agent = await start_agent(cluster, tmp_path, node, root, 10 * SIZE)
    try:

        async def reported() -> dict[str, Any] | None:
            status = await report(cluster, node)
            return status if status.get("heartbeat") != first["heartbeat"] else None

        status = await eventually(reported, what="the partial copy reported")
        assert status["partial"] == [{"content": partial, "bytes": SIZE, "copying": False}]
        assert held(status) == [] and node_cache.partial_dir(root, partial).is_dir()
    finally:
        assert await agent.stop() == 0


async def test_a_root_it_cannot_read_is_reported_and_a_bad_one_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    a = make_copy(root, 1, SIZE)
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
            return held(await report(cluster, node)) == [a]

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


async def test_evicts_nothing_while_it_cannot_know_what_is_kept(tmp_path: Path) -> None:
    """No API server to read the NodeCache's spec from: over budget, yet every copy stays."""
    root = tmp_path / "root"
    a = make_copy(root, 1, SIZE)
    b = make_copy(root, 2, SIZE, partial=True)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{free_port()}")
    agent = AgentProcess("n1", root, 1, kubeconfig, tmp_path / "agent.log").start()
    try:

        async def passes() -> bool:
            return agent.log.read_text().count("cannot read NodeCache n1") >= 2

        await eventually(passes, what="two passes without the API server")
    finally:
        assert await agent.stop() == 0
    assert (node_cache.copy_dir(root, a) / "modelstage.json").exists()
    assert node_cache.partial_dir(root, b).is_dir()
