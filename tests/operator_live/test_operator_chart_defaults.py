"""The operator as the chart installs it by default, on a real API server: its args, its
settings, its ServiceAccount's token and nothing more (namespaced, node caching off); and the
chart's namespaced values with node caching on.

A namespaced operator has no right to cluster-scoped objects; with node caching off it needs
none, and must not try: a refused watch is retried by kopf without end (a forbidden list every
few seconds in its log, and nothing else it watches is affected, so it looks healthy). A
ModelDeployment that asks for node caching then gets a finding saying it is not installed,
and the operator lists no Node and no NodeCache for it. Real tier only: kmock has no RBAC.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from modelstage.api.objects import Owner
from modelstage.operator.node_cache_volume import plan_volume
from operator_live.conftest import CRD, PEERING_CRDS
from support.charts import RELEASE_NAMESPACE, of_kind, one, render_docs
from support.kube_cluster import (
    KIND_PATHS,
    ApiStatusError,
    ControlPlane,
    KubeHTTP,
    apply_crd,
    collection_path,
    create_all,
    eventually,
    service_account_token,
    write_kubeconfig,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]
NODE_CACHE_CRD = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "crds" / "modelstage.io_nodecaches.yaml").read_text()
)
SETTLE_SECONDS = 12.0
"""Longer than kopf's first retries of a refused watch (1, 2, 5 s...)."""


def chart_operator(docs: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """The operator container's arguments and plain settings as the chart renders them; the
    pod-IP endpoints (liveness, metrics) are the test's own, on 127.0.0.1."""
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    args = [a for a in container["args"] if not a.startswith(("--liveness", "--log-format"))]
    env = {
        e["name"]: e["value"]
        for e in container["env"]
        if "value" in e and e["name"].startswith("MODELSTAGE_")
        and not e["name"].startswith("MODELSTAGE_OPERATOR_METRICS_")
    }  # fmt: skip
    return args, env


@pytest_asyncio.fixture
async def admin(real_control_plane: ControlPlane | None) -> AsyncIterator[KubeHTTP]:
    if real_control_plane is None:
        pytest.skip("RBAC is enforced by kube-apiserver, not kmock: the real tier proves it")
    async with KubeHTTP(real_control_plane.server, real_control_plane.token) as client:
        for crd in (CRD, *PEERING_CRDS):
            await apply_crd(client, crd)
        yield client


def model_deployment(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "modelstage.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": RELEASE_NAMESPACE},
        "spec": {
            "model": {"uri": "s3://models/llama/", "sizeHint": "1Gi"},
            "loadFormat": "sharded_state",
            "storage": {"pvc": {"claimName": "models"}},
            "serving": {"targetRef": {"kind": "Deployment", "name": "vllm"}},
            "nodeCache": {"enabled": True},
        },
    }


async def test_the_charts_default_operator_watches_nothing_it_may_not(
    admin: KubeHTTP, tmp_path: Path
) -> None:
    docs = render_docs()
    installed = [d for d in docs if d["kind"] in KIND_PATHS]
    await create_all(admin, installed)
    account = one(docs, "ServiceAccount")["metadata"]["name"]
    token = await service_account_token(admin, RELEASE_NAMESPACE, account)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", admin.server, token)
    args, env = chart_operator(docs)
    assert "MODELSTAGE_OPERATOR_NODE_CACHE" not in env  # node caching off by default
    process = OperatorProcess(kubeconfig, RELEASE_NAMESPACE, tmp_path, extra_env=env, args=args)
    md_path = f"/apis/modelstage.io/v1alpha1/namespaces/{RELEASE_NAMESPACE}/modeldeployments"
    await process.start()
    try:
        await admin.create(md_path, model_deployment("wants-node-cache"))

        async def found() -> bool:
            body = await admin.get(f"{md_path}/wants-node-cache") or {}
            return "node caching is not installed" in str(body.get("status"))

        await eventually(found, timeout=60, what="the finding that node caching is off")
        await asyncio.sleep(SETTLE_SECONDS)
    finally:
        await process.stop(graceful=False)
        await _remove(admin, installed, f"{md_path}/wants-node-cache")
    log = process.logs()
    assert "modelstage operator started" in log
    for refused in ("forbidden", "Forbidden", "nodecaches", "persistentvolumes", '"nodes"'):
        assert refused not in log, f"{refused!r} in the operator's log:\n{log[-3000:]}"


def node_cache_pv(namespace: str, content: str) -> dict[str, Any]:
    """An operator's node-cache PV for a claim in ``namespace`` that was bound and is gone
    (its claimRef names a uid no claim has)."""
    pv, _ = plan_volume(Owner("llama", namespace, "uid-1"), content, 1)
    pv["spec"]["claimRef"]["uid"] = "a-claim-that-is-gone"
    return pv


async def test_a_namespaced_operator_with_node_caching_reads_claims_only_where_it_serves(
    admin: KubeHTTP, tmp_path: Path
) -> None:
    """At the chart's namespaced values with node caching on, the operator watches PVs
    cluster-wide (its ClusterRole grants that) but may read claims only in the namespaces it
    serves: a released PV of its own namespace is deleted (the handler runs), one whose claim
    was in another namespace is left alone, and nothing is refused and retried."""
    await apply_crd(admin, NODE_CACHE_CRD)
    docs = render_docs("--set", "nodeCache.enabled=true")
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"].count(
        f"--namespace={RELEASE_NAMESPACE}") == 1  # fmt: skip
    installed = [d for d in docs if d["kind"] in KIND_PATHS]
    await create_all(admin, installed)
    account = next(d for d in of_kind(docs, "ServiceAccount")
                   if "node-agent" not in d["metadata"]["name"])["metadata"]["name"]  # fmt: skip
    token = await service_account_token(admin, RELEASE_NAMESPACE, account)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", admin.server, token)
    args, env = chart_operator(docs)
    assert env.get("MODELSTAGE_OPERATOR_NODE_CACHE") == "true"
    ours = node_cache_pv(RELEASE_NAMESPACE, "0a" * 16)
    other = node_cache_pv("not-served", "0b" * 16)
    pvs = "/api/v1/persistentvolumes"
    for pv in (ours, other):
        await admin.create(pvs, pv)
    process = OperatorProcess(kubeconfig, RELEASE_NAMESPACE, tmp_path, extra_env=env, args=args)
    await process.start()
    try:

        async def deleted() -> bool:
            return await admin.get(f"{pvs}/{ours['metadata']['name']}") is None

        await eventually(deleted, timeout=60, what="the released PV of the served namespace gone")
        await asyncio.sleep(SETTLE_SECONDS)
        assert await admin.get(f"{pvs}/{other['metadata']['name']}") is not None
    finally:
        await process.stop(graceful=False)
        await _remove(admin, installed, f"{pvs}/{ours['metadata']['name']}",
                      f"{pvs}/{other['metadata']['name']}")  # fmt: skip
    log = process.logs()
    assert "modelstage operator started" in log
    for refused in ("forbidden", "Forbidden", "not-served"):
        assert refused not in log, f"{refused!r} in the operator's log:\n{log[-3000:]}"


async def _remove(admin: KubeHTTP, docs: list[dict[str, Any]], *paths: str) -> None:
    """The cluster-scoped objects and the ModelDeployment go (the control plane outlives the
    test); the namespace's own objects may stay for the next test of this module."""
    for path in paths:
        try:
            await admin.request("PATCH", path, {"metadata": {"finalizers": None}},
                                content_type="application/merge-patch+json")  # fmt: skip
            await admin.delete(path)
        except ApiStatusError as error:
            assert error.status == 404, error
    for doc in docs:
        if doc["metadata"].get("namespace"):
            continue
        try:
            await admin.delete(f"{collection_path(doc)}/{doc['metadata']['name']}")
        except ApiStatusError as error:
            assert error.status == 404, error
