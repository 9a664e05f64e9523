"""The chart's node-cache RBAC and admission policies on a real API server.

The chart's rendered ServiceAccounts, ClusterRoles, bindings and ValidatingAdmissionPolicies
(``nodeCache.enabled=true``) are created on the real tier's API server; then the agent's own
token, bound to a pod on node A as the kubelet's is (so it carries the node-name claim), makes
the calls the agent makes (review a token, read and label its Node, create its NodeCache,
patch its status), and every write its role allows is tried on the other node, B: the
admission policy refuses each. A SubjectAccessReview of every verb on every resource
concerned says that the agent and the operator may do exactly what the chart's tables say.
RBAC and admission are the API server's: kmock enforces neither, so this runs on the real tier
only (``KUBEBUILDER_ASSETS``).
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
from modelstage.api.nodecache import NodeCacheReport
from modelstage.core import node_cache as nc
from operator_live.conftest import CRD
from support.charts import RELEASE_NAMESPACE, render_docs
from support.kube_cluster import (
    RBAC_KINDS,
    ApiStatusError,
    ControlPlane,
    KubeHTTP,
    apply_crd,
    create_all,
    eventually,
    service_account_token,
)

ROOT = Path(__file__).resolve().parents[2]
NODE_CACHE_CRD: dict[str, Any] = yaml.safe_load(
    (ROOT / "crds" / "modelstage.io_nodecaches.yaml").read_text()
)
NODES = "/api/v1/nodes"
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
NODE_CACHES = f"/apis/{nc.API_VERSION}/{nc.PLURAL}"
OWN, OTHER = "chart-rbac-node-a", "chart-rbac-node-b"
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
RESOURCES = [
    ("", "nodes"),
    ("", "pods"),
    ("", "secrets"),
    ("", "persistentvolumes"),
    ("authentication.k8s.io", "tokenreviews"),
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
    "ValidatingAdmissionPolicy": f"{ADMISSION}/validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": f"{ADMISSION}/validatingadmissionpolicybindings",
}
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
AGENT_POD = "node-agent-on-a-"


def _node(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"team": "gpu"}},
        "spec": {"taints": [{"key": "gpu", "value": "h100", "effect": "NoSchedule"}]},
    }


def _node_cache(name: str) -> dict[str, Any]:
    return {"apiVersion": nc.API_VERSION, "kind": nc.KIND, "metadata": {"name": name}}


def _policies() -> list[dict[str, Any]]:
    return [d for d in render_docs("--set", "nodeCache.enabled=true") if d["kind"] in POLICY_KINDS]


@pytest_asyncio.fixture
async def admin(real_control_plane: ControlPlane | None) -> AsyncIterator[KubeHTTP]:
    """Cluster admin on the real tier, with the chart's node-cache RBAC and two Nodes; all of
    it removed afterwards (the control plane outlives the test)."""
    if real_control_plane is None:
        pytest.skip("RBAC is enforced by kube-apiserver, not kmock: the real tier proves it")
    docs = [d for d in render_docs("--set", "nodeCache.enabled=true") if d["kind"] in RBAC_KINDS]
    async with KubeHTTP(real_control_plane.server, real_control_plane.token) as client:
        for crd in (CRD, NODE_CACHE_CRD):
            await apply_crd(client, crd)
        await create_all(client, docs)
        for name in (OWN, OTHER):
            await client.create(NODES, _node(name))
            await client.create(NODE_CACHES, _node_cache(name))
        try:
            yield client
        finally:
            policies = [f"{RBAC_PATHS[d['kind']]}/{d['metadata']['name']}" for d in _policies()]
            pods = f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods"
            for pod in await client.list(pods):  # bound to a node: gone at once, no kubelet
                name = pod["metadata"]["name"]
                await client.request("DELETE", f"{pods}/{name}", gracePeriodSeconds="0")
            for path in (
                [f"{NODES}/{n}" for n in (OWN, OTHER)]
                + [f"{NODE_CACHES}/{n}" for n in (OWN, OTHER)]
                + policies
                + [
                    f"{RBAC_PATHS[d['kind']]}/{d['metadata']['name']}"
                    for d in docs
                    if d["kind"] in RBAC_PATHS
                ]
            ):
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
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{RELEASE_NAMESPACE}",
                "system:authenticated",
            ],
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


async def _agent_on_a(admin: KubeHTTP) -> str:
    """The agent's token as its pod on node A has it: a TokenRequest bound to that pod, so the
    API server adds the node-name claim (Kubernetes >= 1.30)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": AGENT_POD, "namespace": RELEASE_NAMESPACE},
        "spec": {
            "nodeName": OWN,
            "serviceAccountName": AGENT,
            "automountServiceAccountToken": False,
            "containers": [{"name": "agent", "image": "modelstage:test"}],
        },
    }
    created = await admin.create(f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods", pod)
    return await service_account_token(
        admin,
        RELEASE_NAMESPACE,
        AGENT,
        bound_pod=(created["metadata"]["name"], created["metadata"]["uid"]),
    )


async def _refused(call: Any, *words: str) -> None:
    with pytest.raises(ApiStatusError) as refused:
        await call
    assert refused.value.status in (403, 422), refused.value
    message = str(refused.value.body.get("message"))
    assert all(w in message for w in words), message


async def _installed_policies(admin: KubeHTTP, agent: KubeHTTP) -> None:
    """The chart's policies, created, and in force once a write they deny is denied (the API
    server loads them a moment after they are created)."""
    await create_all(admin, _policies())
    other_label = {"metadata": {"labels": {"probe": "x"}}}

    async def denied() -> bool:
        try:
            await agent.patch(f"{NODES}/{OTHER}", other_label)
        except ApiStatusError as error:
            return error.status in (403, 422) and "ValidatingAdmissionPolicy" in str(error.body)
        await admin.patch(f"{NODES}/{OTHER}", {"metadata": {"labels": {"probe": None}}})
        return False

    await eventually(denied, timeout=30, what="the agent's admission policy in force")


async def test_the_agent_can_make_its_calls_with_the_charts_role_and_policies(
    admin: KubeHTTP,
) -> None:
    token = await _agent_on_a(admin)
    report = NodeCacheReport(node=OWN, root=nc.POD_MOUNT, budget_bytes=10**12,
                             heartbeat=datetime.now(UTC))  # fmt: skip
    label = nc.content_label("0123456789abcdef" * 2)
    async with KubeHTTP(admin.server, token) as agent:
        await _installed_policies(admin, agent)
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        }
        reviewed = await agent.create("/apis/authentication.k8s.io/v1/tokenreviews", review)
        extra = reviewed["status"]["user"]["extra"]
        assert extra["authentication.kubernetes.io/node-name"] == [OWN]
        assert (await agent.get(f"{NODES}/{OWN}")) is not None
        node = await agent.patch(f"{NODES}/{OWN}", {"metadata": {"labels": {label: "true"}}})
        assert node["metadata"]["labels"][label] == "true"
        await agent.patch(f"{NODES}/{OWN}", {"metadata": {"labels": {label: None}}})
        status = report.model_dump(mode="json", by_alias=True, exclude_none=True)
        written = await agent.patch(f"{NODE_CACHES}/{OWN}/status", {"status": status})
        assert written["status"]["budgetBytes"] == 10**12
        await admin.delete(f"{NODE_CACHES}/{OWN}")
        await agent.create(NODE_CACHES, _node_cache(OWN))
        # What RBAC refuses, with its own token.
        for call in (
            agent.delete(f"{NODES}/{OTHER}"),
            agent.patch(f"{NODE_CACHES}/{OWN}", {"metadata": {"labels": {"x": "y"}}}),
            agent.request("GET", "/api/v1/secrets"),
            agent.list(f"/apis/{nc.API_VERSION}/modeldeployments"),
        ):
            with pytest.raises(ApiStatusError) as refused:
                await call
            assert refused.value.status == 403, refused.value


async def test_the_admission_policy_holds_the_agent_to_its_own_node(admin: KubeHTTP) -> None:
    """Every write the agent's role allows, on node B and its NodeCache, with the token of
    the agent on node A: refused by the policy; the same on its own node outside the label
    prefix: refused; and node B is unchanged."""
    token = await _agent_on_a(admin)
    label = nc.content_label("0123456789abcdef" * 2)
    taint = {"key": "evil", "effect": "NoExecute"}
    status = {"status": {"node": OTHER, "root": "/x", "budgetBytes": 1,
                         "heartbeat": "2026-01-01T00:00:00Z"}}  # fmt: skip
    async with KubeHTTP(admin.server, token) as agent:
        await _installed_policies(admin, agent)
        before = await admin.get(f"{NODES}/{OTHER}")
        await _refused(agent.patch(f"{NODES}/{OTHER}", {"metadata": {"labels": {label: "true"}}}),
                       "only its own Node", OTHER)  # fmt: skip
        await _refused(agent.patch(f"{NODES}/{OTHER}", {"spec": {"taints": [taint]}}),
                       "only its own Node")  # fmt: skip
        await _refused(agent.patch(f"{NODES}/{OTHER}", {"spec": {"unschedulable": True}}))
        await _refused(agent.patch(f"{NODE_CACHES}/{OTHER}/status", status),
                       "only its own NodeCache")  # fmt: skip
        await admin.delete(f"{NODE_CACHES}/{OTHER}")
        await _refused(agent.create(NODE_CACHES, _node_cache(OTHER)), "only its own NodeCache")
        assert await admin.get(f"{NODE_CACHES}/{OTHER}") is None
        after = await admin.get(f"{NODES}/{OTHER}")
        assert after is not None and before is not None
        assert after["metadata"].get("labels") == before["metadata"].get("labels")
        assert after["spec"] == before["spec"]
        # Its own node: labels under the prefix only; no taint, no other label.
        await _refused(agent.patch(f"{NODES}/{OWN}", {"spec": {"taints": [taint]}}), "labels")
        await _refused(
            agent.patch(f"{NODES}/{OWN}", {"metadata": {"labels": {"team": "cpu"}}}), "labels"
        )
        await _refused(agent.patch(
            f"{NODES}/{OWN}",
            {"metadata": {"labels": {"node-restriction.kubernetes.io/pool": "x"}}},
        ), "labels")  # fmt: skip
        await _refused(agent.patch(f"{NODES}/{OWN}", {"metadata": {"annotations": {"a": "b"}}}))
        done = await agent.patch(f"{NODES}/{OWN}", {"metadata": {"labels": {label: "true"}}})
        assert done["metadata"]["labels"] == {"team": "gpu", label: "true"}


async def test_a_token_without_the_node_claim_changes_nothing(admin: KubeHTTP) -> None:
    """A token of the agent's account not bound to a pod (no node-name claim): refused."""
    token = await service_account_token(admin, RELEASE_NAMESPACE, AGENT)
    label = nc.content_label("0123456789abcdef" * 2)
    async with KubeHTTP(admin.server, token) as agent:
        await create_all(admin, _policies())

        async def denied() -> bool:
            try:
                await agent.patch(f"{NODES}/{OWN}", {"metadata": {"labels": {label: "true"}}})
            except ApiStatusError as error:
                return "node-name claim" in str(error.body)
            return False

        await eventually(denied, timeout=30, what="a token without the node claim refused")


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
                            (nc.API_GROUP, f"{nc.PLURAL}/status"),
                            ("", "persistentvolumes")}  # fmt: skip
    operator_allowed = {
        (group, resource, verb)
        for (group, resource), verb in itertools.product(sorted(node_cache_resources), VERBS)
        if await _allowed(admin, operator, group, resource, verb)
    }
    assert operator_allowed == OPERATOR_NODE_CACHE_RULES
