"""Helpers of the node cache tests (tests/agent): the staged artifacts' chunk size,
digests, hand-made copies in the agent's on-node layout, and the agent as a local process with
its least-privilege identity (its copy server on 127.0.0.1, a free port)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from modelstage.core import node_cache
from modelstage.core.integrity import digest_bytes
from modelstage.core.manifest import MANIFEST, FileEntry, Manifest

from support.charts import RELEASE, RELEASE_NAMESPACE, of_kind, render_docs
from support.kube_cluster import Cluster, create_all, service_account_token, write_kubeconfig

CHUNK = 256 * 1024
"""Hash chunk of the staged test artifacts: a rank file holds several."""


def digest_of(artifact: Path) -> str:
    digest: str = json.loads((artifact / MANIFEST).read_text())["digest"]
    return digest


def fake_digest(i: int) -> str:
    """A well-formed digest of a hand-made copy."""
    return f"{i:02x}" * 10


def copy_manifest(digest: str, data: bytes, chunk: int = CHUNK) -> bytes:
    """The manifest bytes of a one-file safetensors artifact holding ``data``."""
    manifest = Manifest(
        format="safetensors", tensorParallelSize=1, dtype="float32", digest=digest, source={},
        vllmVersion="0.32", layoutVersion="1",
        files={"model.safetensors": FileEntry.of(digest_bytes(data, chunk))}, bytes=len(data),
        modelstageVersion="0.1.0", createdAt="2026-01-01T00:00:00Z", stageSeconds=1.0,
    )  # fmt: skip
    return manifest.to_json().encode()


def make_copy(
    root: Path,
    seed: int,
    size: int,
    *,
    last_used: datetime | None = None,
    grants: list[tuple[str, str]] | None = None,
    partial: bool = False,
) -> str:
    """A complete copy (or a partial one: its file, no manifest) of ``size`` random bytes
    under ``root`` in the agent's layout (content-addressed, canonical manifest, 0440/0550),
    with its record granting ``grants`` (default: namespace ``ns`` for ``fake_digest(seed)``);
    its content."""
    data = os.urandom(size)
    raw = copy_manifest(fake_digest(seed), data)
    content = node_cache.content_address(raw)
    directory = node_cache.partial_dir(root, content) if partial else node_cache.copy_dir(root, content)
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(data)
    if partial:
        return content
    (directory / MANIFEST).write_bytes(node_cache.canonical_manifest(raw))
    for f in directory.iterdir():
        f.chmod(0o440)
    directory.chmod(0o550)
    given = [("ns", fake_digest(seed))] if grants is None else grants
    record: dict[str, Any] = {"content": content, "copiedAt": "2026-01-01T00:00:00+00:00",
                              "copySeconds": 2.0,
                              "grants": [{"namespace": n, "digest": d} for n, d in given]}  # fmt: skip
    if last_used is not None:
        record["lastUsed"] = last_used.isoformat()
    state = node_cache.state_file(root, content)
    state.parent.mkdir(exist_ok=True)
    state.write_text(json.dumps(record))
    return content


def agent_rules() -> list[dict[str, Any]]:
    """The node agent's permissions as the chart grants them (its ClusterRole with node
    caching on): on the real tier the agent under test holds exactly these, so the tests prove
    that the chart's least-privilege role is enough."""
    name = f"{RELEASE}-modelstage-node-agent"
    role = next(r for r in of_kind(render_docs("--set", "nodeCache.enabled=true"), "ClusterRole")
                if r["metadata"]["name"] == name)  # fmt: skip
    rules: list[dict[str, Any]] = role["rules"]
    return rules


async def agent_kubeconfig(cluster: Cluster, path: Path) -> Path:
    """A kubeconfig for the agent: on the real tier a ServiceAccount bound to the chart's agent role (``agent_rules``)
    only; on kmock (no authorization) the tests' own."""
    if cluster.tier != "real":
        return cluster.kubeconfig
    ns, name = "modelstage-agent", "modelstage-node-agent"
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": name}, "rules": agent_rules()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": name},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]},
    ]  # fmt: skip
    await create_all(cluster.client, docs)
    token = await service_account_token(cluster.client, ns, name)
    return write_kubeconfig(path, cluster.server, token)


AGENT_ACCOUNT = f"{RELEASE}-modelstage-node-agent"
"""The chart's node agent ServiceAccount (in the release's namespace): the name the chart's
admission policy holds to its own node."""


async def node_bound_agent_kubeconfig(cluster: Cluster, node: str, path: Path) -> Path:
    """The agent's kubeconfig as its DaemonSet pod on ``node`` holds it (real tier): the
    chart's agent ServiceAccount, ClusterRole and binding, and a token bound to a pod on that
    node, so it carries the node-name claim the chart's admission policy checks."""
    docs = [d for d in render_docs("--set", "nodeCache.enabled=true")
            if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
            and d["metadata"]["name"] == AGENT_ACCOUNT]  # fmt: skip
    await create_all(cluster.client, docs)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": f"node-agent-{node}-", "namespace": RELEASE_NAMESPACE,
                        "labels": {AGENT_POD_LABEL: "true"}},
           "spec": {"nodeName": node, "serviceAccountName": AGENT_ACCOUNT,
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "agent", "image": "modelstage:test"}]}}  # fmt: skip
    created = await cluster.client.create(f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods", pod)
    meta = created["metadata"]
    token = await service_account_token(cluster.client, RELEASE_NAMESPACE, AGENT_ACCOUNT,
                                        bound_pod=(meta["name"], meta["uid"]))  # fmt: skip
    return write_kubeconfig(path, cluster.server, token)


AGENT_POD_LABEL = "modelstage.io/test-node-agent"
"""Marks the pods ``node_bound_agent_kubeconfig`` binds tokens to (removed by the tests)."""


async def remove_agent_pods(cluster: Cluster) -> None:
    pods = f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods"
    for pod in await cluster.client.list(pods):
        if AGENT_POD_LABEL in (pod["metadata"].get("labels") or {}):
            await cluster.client.request("DELETE", f"{pods}/{pod['metadata']['name']}",
                                         gracePeriodSeconds="0")  # fmt: skip


@dataclass
class AgentProcess:
    """``modelstage agent`` as a local process for one simulated node."""

    node: str
    root: Path
    budget: int
    kubeconfig: Path
    log: Path
    metrics_port: int = 0
    interval: float = 0.2
    verify_rate: str = "0"
    namespace_quota: str = "0"
    allow_tokens_without_node: bool = False
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        """The agent with its copy server on 127.0.0.1, any free port (its NodeCache's
        ``status.endpoint`` says which)."""
        cmd = [sys.executable, "-m", "modelstage.stager.cli", "agent", "--node", self.node,
               "--root", str(self.root), "--budget", str(self.budget), "--interval",
               str(self.interval), "--kubeconfig", str(self.kubeconfig), "--copy-address",
               "127.0.0.1", "--copy-port", "0", "--verify-rate", self.verify_rate,
               "--namespace-quota", self.namespace_quota]  # fmt: skip
        if self.allow_tokens_without_node:
            cmd.append("--allow-tokens-without-node")
        if self.metrics_port:
            cmd += ["--metrics-port", str(self.metrics_port)]
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        env.pop("KUBECONFIG", None)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            cwd="/")  # fmt: skip
        return self

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = await asyncio.to_thread(self.process.wait, 60)
        return code

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            text: str = r.read().decode()
            return text
