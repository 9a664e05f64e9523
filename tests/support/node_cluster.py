"""The live tests' cluster for node caching: the ModelDeployment and NodeCache APIs served,
Nodes creatable (kmock: registered), and on the real tier the operator holding the chart's
node-cache ClusterRole (rendered with node caching on), so that the real API server proves
the chart grants enough. Nodes and reports are removed afterwards (the control plane outlives
a test)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from modelstage.api.kube_client import resource_path
from modelstage.core import node_cache as nc

from support.charts import RELEASE, of_kind, render_docs
from support.kube_cluster import (
    ApiStatusError,
    Cluster,
    ControlPlane,
    chart_rbac,
    create_all,
    kmock_cluster,
    real_cluster,
)
from support.kube_fake import ResourceSpec

ROOT = Path(__file__).resolve().parents[2]
CRDS: list[dict[str, Any]] = [
    yaml.safe_load((ROOT / "crds" / "modelstage.io_modeldeployments.yaml").read_text()),
    yaml.safe_load((ROOT / "crds" / "modelstage.io_nodecaches.yaml").read_text()),
    *[d for d in yaml.safe_load_all((ROOT / "crds" / "kopf.dev_peerings.yaml").read_text()) if d],
]
OPERATOR_ROLE = f"{RELEASE}-modelstage-node-cache"


def operator_node_cache_rules() -> list[dict[str, Any]]:
    """The operator's node-cache ClusterRole's rules, as the chart renders them."""
    role = next(r for r in of_kind(render_docs("--set", "nodeCache.enabled=true"), "ClusterRole")
                if r["metadata"]["name"] == OPERATOR_ROLE)  # fmt: skip
    rules: list[dict[str, Any]] = role["rules"]
    return rules


@contextlib.asynccontextmanager
async def node_cache_cluster(
    real_control_plane: ControlPlane | None, tmp_path: Path
) -> AsyncIterator[Cluster]:
    if real_control_plane is None:
        async with kmock_cluster(CRDS, tmp_path) as fake_cluster:
            fake_cluster.fake.register(ResourceSpec("v1", "nodes", "Node"), namespaced=False)
            fake_cluster.fake.register(
                ResourceSpec("v1", "persistentvolumes", "PersistentVolume"), namespaced=False
            )
            yield fake_cluster
        return
    async with real_cluster(real_control_plane, CRDS, tmp_path) as real:
        account = next(d for d in chart_rbac("default") if d["kind"] == "ServiceAccount")
        name = "modelstage-test-node-cache"
        subject = {"kind": "ServiceAccount", "name": account["metadata"]["name"],
                   "namespace": account["metadata"]["namespace"]}  # fmt: skip
        await create_all(real.client, [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": name}, "rules": operator_node_cache_rules()},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": name}, "subjects": [subject],
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": name}},
        ])  # fmt: skip
        try:
            yield real
        finally:
            for path in (resource_path("v1", "nodes"), resource_path(nc.API_VERSION, nc.PLURAL),
                         resource_path("v1", "persistentvolumes")):  # fmt: skip
                for obj in await real.client.list(path):
                    try:
                        await real.client.delete(f"{path}/{obj['metadata']['name']}")
                    except ApiStatusError as e:  # a report the garbage collector took with its Node
                        if e.status != 404:
                            raise


def now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


async def add_node(
    cluster: Cluster,
    name: str,
    labels: dict[str, str],
    taints: list[dict[str, str]] | None = None,
) -> None:
    """A Node as the API holds one once its kubelet registered and reports Ready."""
    await cluster.client.create(
        resource_path("v1", "nodes"),
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": labels},
            "spec": {"taints": taints or []},
        },
    )
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ready"}
    await cluster.client.patch(
        resource_path("v1", "nodes", None, name, "status"),
        {"status": {"conditions": [{**ready, "lastHeartbeatTime": now()}]}},
    )
    # The real API server taints a new Node not-ready (admission); the node lifecycle
    # controller lifts that once it is Ready: the tests play that controller too.
    await cluster.client.patch(
        resource_path("v1", "nodes", None, name), {"spec": {"taints": taints or None}}
    )
