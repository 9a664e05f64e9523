"""The copy server's authentication on the real API server (``KUBEBUILDER_ASSETS``): tokens
made by kube-apiserver's TokenRequest API exactly as the kubelet gets a copy Job's projected
token (audience ``modelstage-node-agent``, bound to the Job's pod, which runs on a node), and
reviewed by the agent with a TokenReview under a ServiceAccount that may do nothing else. A
token of a pod on this node streams a copy and is granted it; a pod on another node, another
audience, and a token bound to no pod (no node claim) are refused."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from modelstage.agent import store
from modelstage.agent.agent import kube_client
from modelstage.agent.auth import TokenReviewer
from modelstage.agent.receive import Receiver
from modelstage.agent.server import CopyServer
from modelstage.api.kube_client import resource_path
from modelstage.core import node_cache
from modelstage.stager.cli import main
from support.kube_cluster import (
    ApiStatusError,
    Cluster,
    create_all,
    eventually,
    new_namespace,
    service_account_token,
    write_kubeconfig,
)
from support.node_agent import digest_of

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]
NODE = "tokens-n1"
OTHER = "tokens-n2"


@pytest_asyncio.fixture
async def real(cluster: Cluster) -> AsyncIterator[Cluster]:
    if cluster.tier != "real":
        pytest.skip("tokens are made and reviewed by kube-apiserver: the real tier proves it "
                    "(tests/agent/test_node_copy.py checks the same rules on every tier)")  # fmt: skip
    yield cluster

    async def listed() -> bool:  # the cluster's teardown lists NodeCaches: once it can
        try:
            await cluster.client.list(resource_path(node_cache.API_VERSION, node_cache.PLURAL))
        except ApiStatusError as e:
            if e.status != 429:  # the CRD's storage still initializing: again
                raise
            return False
        return True

    await eventually(listed, what="NodeCaches listed")


async def reviewer_kubeconfig(cluster: Cluster, path: Path) -> Path:
    """A ServiceAccount whose only right is ``tokenreviews create`` (the agent's, for this)."""
    ns, name = "modelstage-agent-tokens", "reviewer"
    await create_all(cluster.client, [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "modelstage-test-token-reviewer"},
         "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                    "verbs": ["create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "modelstage-test-token-reviewer"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "modelstage-test-token-reviewer"},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]},
    ])  # fmt: skip
    token = await service_account_token(cluster.client, ns, name)
    return write_kubeconfig(path, cluster.server, token)


async def job_token(
    cluster: Cluster, ns: str, node: str | None, audience: str | None = node_cache.AGENT_AUDIENCE
) -> str:
    """A copy Job's projected token: its ServiceAccount's, bound to a pod on ``node`` (None:
    bound to nothing), for ``audience`` (None: the API server's own)."""
    sa = f"copy-{uuid.uuid4().hex[:6]}"
    await cluster.client.create(resource_path("v1", "serviceaccounts", ns),
                                {"metadata": {"name": sa, "namespace": ns}})  # fmt: skip
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if audience is not None:
        spec["audiences"] = [audience]
    if node is not None:
        pod = await cluster.client.create(resource_path("v1", "pods", ns), {
            "metadata": {"name": sa, "namespace": ns},
            "spec": {"nodeName": node, "serviceAccountName": sa,
                     "automountServiceAccountToken": False,
                     "containers": [{"name": "copy", "image": "modelstage:test"}]},
        })  # fmt: skip
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": sa,
                                  "uid": pod["metadata"]["uid"]}  # fmt: skip
    path = f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token"
    answer = await cluster.client.create(path, {"apiVersion": "authentication.k8s.io/v1",
                                                "kind": "TokenRequest", "spec": spec})  # fmt: skip
    token: str = answer["status"]["token"]
    return token


async def node(cluster: Cluster, name: str) -> None:
    if await cluster.client.get(resource_path("v1", "nodes", name=name)) is None:
        await cluster.client.create(resource_path("v1", "nodes"),
                                    {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})  # fmt: skip


async def test_the_api_servers_tokens_pass_only_for_a_pod_on_this_node(
    real: Cluster, tmp_path: Path, artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in (NODE, OTHER):
        await node(real, name)
    ns = await new_namespace(real, f"tenant-{uuid.uuid4().hex[:6]}")
    kube = kube_client(str(await reviewer_kubeconfig(real, tmp_path / "reviewer")))
    root = tmp_path / "root"
    root.mkdir()
    server = CopyServer(("127.0.0.1", 0), Receiver(root, NODE, 10**10),
                        TokenReviewer(kube, NODE))  # fmt: skip
    server.start()
    try:
        cases = {
            "here": (await job_token(real, ns, NODE), None),
            "other-node": (await job_token(real, ns, OTHER),
                           f"error: the token is bound to a pod on node ['{OTHER}'], not {NODE}"),
            "other-audience": (await job_token(real, ns, NODE, audience=None),
                               "error: the token was refused by the API server: "),
            "no-pod": (await job_token(real, ns, None),
                       "error: the token has no node claim (Kubernetes below 1.30?)"),
        }  # fmt: skip
        for case, (token, refusal) in cases.items():
            (tmp_path / case).write_text(token)
            code = await asyncio.to_thread(main, [
                "node-copy", "--agent", server.url, "--token-file", str(tmp_path / case),
                "--artifact", str(artifact), "--digest", digest_of(artifact)])  # fmt: skip
            out, err = capsys.readouterr()
            if refusal is None:
                assert code == 0, err
                assert json.loads(out.strip().splitlines()[-1])["node"] == NODE
            else:
                assert code == 1 and err.strip().splitlines()[-1].startswith(refusal), (case, err)
        [held] = store.scan(root).copies
        assert held.grants == [(ns, digest_of(artifact))]
    finally:
        server.shutdown()
        server.server_close()
