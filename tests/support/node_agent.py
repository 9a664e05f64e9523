"""Helpers of the node cache tests (tests/node_cache): the staged artifacts' chunk size,
digests, hand-made copies in the on-node layout, and the agent as a local process with its
least-privilege identity."""

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

from support.charts import RELEASE, of_kind, render_docs
from support.kube_cluster import Cluster, create_all, service_account_token, write_kubeconfig

CHUNK = 256 * 1024
"""Hash chunk of the staged test artifacts: a rank file holds several."""


def digest_of(artifact: Path) -> str:
    digest: str = json.loads((artifact / MANIFEST).read_text())["digest"]
    return digest


def fake_digest(i: int) -> str:
    """A well-formed digest of a hand-made copy."""
    return f"{i:02x}" * 10


def make_copy(
    root: Path, digest: str, size: int, *, last_used: datetime | None = None, partial: bool = False
) -> Path:
    """A complete copy (or a partial one, no manifest) of ``size`` bytes under ``root``, in
    the on-node layout, with its record."""
    directory = node_cache.partial_dir(root, digest) if partial else node_cache.copy_dir(root, digest)
    directory.mkdir(parents=True)
    data = os.urandom(size)
    (directory / "model.safetensors").write_bytes(data)
    if partial:
        return directory
    manifest = Manifest(
        format="safetensors", tensorParallelSize=1, dtype="float32", digest=digest, source={},
        vllmVersion="0.32", layoutVersion="1", files={"model.safetensors": FileEntry.of(digest_bytes(data))},
        bytes=size, modelstageVersion="0.1.0", createdAt="2026-01-01T00:00:00Z", stageSeconds=1.0,
    )  # fmt: skip
    (directory / MANIFEST).write_text(manifest.to_json())
    record = {"digest": digest, "bytes": size, "files": 1, "copiedAt": "2026-01-01T00:00:00+00:00",
              "copySeconds": 2.0}  # fmt: skip
    if last_used is not None:
        record["lastUsed"] = last_used.isoformat()
    state = node_cache.state_file(root, digest)
    state.parent.mkdir(exist_ok=True)
    state.write_text(json.dumps(record))
    return directory


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
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        cmd = [sys.executable, "-m", "modelstage.stager.cli", "agent", "--node", self.node,
               "--root", str(self.root), "--budget", str(self.budget), "--interval",
               str(self.interval), "--kubeconfig", str(self.kubeconfig)]  # fmt: skip
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
