"""The chart's node-cache RBAC on a real API server: admitted, enough, and no more.

The chart's rendered ServiceAccounts, ClusterRoles and bindings (``nodeCache.enabled=true``) are
created on the real tier's API server; then the agent's own token makes the calls the agent
makes (list ModelDeployments, read and label its Node, create its NodeCache, patch its status),
and a SubjectAccessReview of every verb on every resource concerned says that the agent and
the operator may do exactly what the chart's tables say. RBAC is the API server's: kmock does
not enforce it, so this runs on the real tier only (``KUBEBUILDER_ASSETS``).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from chart.test_chart_node_cache import AGENT, AGENT_RULES, OPERATOR_NODE_CACHE_RULES
from modelstage.core import node_cache as nc
from modelstage.operator.node_cache_api import NodeCacheReport
from operator_live.conftest import CRD
from support.charts import RELEASE_NAMESPACE, render_docs
from support.kube_cluster import (
    RBAC_KINDS,
    ApiStatusError,
    ControlPlane,
    KubeHTTP,
    apply_crd,
    create_all,
    service_account_token,
)

ROOT = Path(__file__).resolve().parents[2]
NODE_CACHE_CRD: dict[str, Any] = yaml.safe_load(
    (ROOT / "crds" / "modelstage.io_nodecaches.yaml").read_text()
)
NODES = "/api/v1/nodes"
NODE_CACHES = f"/apis/{nc.API_VERSION}/{nc.PLURAL}"
OWN, OTHER = "chart-rbac-node-a", "chart-rbac-node-b"
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
RESOURCES = [
    ("", "nodes"),
    ("", "pods"),
    ("", "secrets"),
    ("batch", "jobs"),
    (nc.API_GROUP, "modeldeployments"),
    (nc.API_GROUP, "modeldeployments/status"),
    (nc.API_GROUP, nc.PLURAL),
    (nc.API_GROUP, f"{nc.PLURAL}/status"),
]
"""What an agent or the operator could want on a node: each verb on each is reviewed."""
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
RBAC_PATHS = {
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
}


def _node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


@pytest_asyncio.fixture
async def admin(real_control_plane: ControlPlane | None) -> AsyncIterator[KubeHTTP]:
    """Cluster admin on the real tier, with the chart's node-cache RBAC and two Nodes; all of
    it removed afterwards (the control plane outlives the test)."""
    if real_control_plane is None:
        pytest.skip("RBAC is enforced by kube-apiserver, not kmock: the real tier proves it")
    docs = [
        d
        for d in render_docs("--set", "nodeCache.enabled=true")
        if d["kind"] in RBAC_KINDS
    ]
    async with KubeHTTP(real_control_plane.server, real_control_plane.token) as client:
        for crd in (CRD, NODE_CACHE_CRD):
            await apply_crd(client, crd)
        await create_all(client, docs)
        for name in (OWN, OTHER):
            await client.create(NODES, _node(name))
        try:
            yield client
        finally:
            for path in [f"{NODES}/{n}" for n in (OWN, OTHER)] + [f"{NODE_CACHES}/{OWN}"] + [
                f"{RBAC_PATHS[d['kind']]}/{d['metadata']['name']}"
                for d in docs
                if d["kind"] in RBAC_PATHS
            ]:
                try:
                    await client.delete(path)
                except ApiStatusError as error:
                    assert error.status == 404, error


async def _allowed(admin: KubeHTTP, account: str, group: str, resource: str, verb: str) -> bool:
    plural, _, sub = resource.partition("/")
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{RELEASE_NAMESPACE}:{account}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{RELEASE_NAMESPACE}",
                       "system:authenticated"],
            "resourceAttributes": {
                "group": group,
                "resource": plural,
                "subresource": sub,
                "verb": verb,
            },
        },
    }
    answer = await admin.create("/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    return bool(answer["status"].get("allowed"))


async def test_the_agent_can_make_its_calls_with_the_charts_role(admin: KubeHTTP) -> None:
    token = await service_account_token(admin, RELEASE_NAMESPACE, AGENT)
    server = admin.server
    report = NodeCacheReport(node=OWN, root=nc.POD_MOUNT, budget_bytes=10**12,
                             heartbeat=datetime.now(UTC))  # fmt: skip
    async with KubeHTTP(server, token) as agent:
        await agent.list(f"/apis/{nc.API_VERSION}/modeldeployments")
        assert (await agent.get(f"{NODES}/{OWN}")) is not None
        label = nc.node_label("0123456789abcdef0123")
        node = await agent.patch(f"{NODES}/{OWN}", {"metadata": {"labels": {label: "true"}}})
        assert node["metadata"]["labels"][label] == "true"
        assert await agent.get(f"{NODE_CACHES}/{OWN}") is None
        await agent.create(
            NODE_CACHES,
            {"apiVersion": nc.API_VERSION, "kind": nc.KIND, "metadata": {"name": OWN}},
        )
        status = report.model_dump(mode="json", by_alias=True, exclude_none=True)
        written = await agent.patch(f"{NODE_CACHES}/{OWN}/status", {"status": status})
        assert written["status"]["budgetBytes"] == 10**12
        # What it may not do, with its own token: a sample of the writes RBAC refuses.
        for call in (
            agent.delete(f"{NODES}/{OTHER}"),
            agent.patch(f"{NODE_CACHES}/{OWN}", {"metadata": {"labels": {"x": "y"}}}),
            agent.delete(f"{NODE_CACHES}/{OWN}"),
            agent.request("GET", "/api/v1/secrets"),
            agent.patch(f"/apis/{nc.API_VERSION}/namespaces/serving/modeldeployments/x/status",
                        {"status": {}}),
        ):
            with pytest.raises(ApiStatusError) as refused:
                await call
            assert refused.value.status == 403, refused.value


async def test_the_agent_and_the_operator_may_do_exactly_the_charts_tables(
    admin: KubeHTTP,
) -> None:
    """Every verb on every resource concerned, cluster-wide, asked of the API server's
    authorizer."""
    operator = next(
        d["metadata"]["name"]
        for d in render_docs("--set", "nodeCache.enabled=true")
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] != AGENT
    )
    agent_allowed = {
        (group, resource, verb)
        for (group, resource), verb in itertools.product(RESOURCES, VERBS)
        if await _allowed(admin, AGENT, group, resource, verb)
    }
    assert agent_allowed == AGENT_RULES
    node_cache_resources = {("", "nodes"), (nc.API_GROUP, nc.PLURAL),
                            (nc.API_GROUP, f"{nc.PLURAL}/status")}  # fmt: skip
    operator_allowed = {
        (group, resource, verb)
        for (group, resource), verb in itertools.product(sorted(node_cache_resources), VERBS)
        if await _allowed(admin, operator, group, resource, verb)
    }
    assert operator_allowed == OPERATOR_NODE_CACHE_RULES
