"""Watch expiry: a watch that resumes from a resourceVersion the API server no longer holds gets
410 Expired, and the operator re-lists and goes on reconciling.

On the real tier this module runs its own control plane with ``--watch-cache=false`` and
compacts etcd: the watch cache would otherwise keep minutes of history, and the expiry a
long-lived cluster shows after an idle watch could not be forced in seconds. On kmock the fake
forgets its history (``FakeKubeAPI.compact``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from operator_live.conftest import CRD, PEERING_CRDS
from support.kube_cluster import (
    Cluster,
    ControlPlane,
    assets_folder,
    control_plane,
    eventually,
    kmock_cluster,
    real_cluster,
)
from support.modelstage_objects import (
    SPEC,
    deploy_path,
    digest_of,
    md_path,
    merged,
    vllm_deployment,
)
from support.operator_flow import MD, apply, wait_job
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def uncached_control_plane(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ControlPlane | None]:
    assets = assets_folder()
    if assets is None:
        yield None
        return
    folder = tmp_path_factory.mktemp("uncached-control-plane")
    with control_plane(assets, folder, ("--watch-cache=false",)) as plane:
        yield plane


@pytest_asyncio.fixture
async def cluster(
    uncached_control_plane: ControlPlane | None, tmp_path: Path
) -> AsyncIterator[Cluster]:
    if uncached_control_plane is None:
        async with kmock_cluster([CRD, *PEERING_CRDS], tmp_path) as fake_cluster:
            yield fake_cluster
        return
    async with real_cluster(uncached_control_plane, [CRD, *PEERING_CRDS], tmp_path) as real:
        yield real


async def test_a_watch_from_a_forgotten_resource_version_gets_410_expired(
    cluster: Cluster, namespace: str
) -> None:
    created = await cluster.client.create(deploy_path(namespace, None), vllm_deployment("w"))
    since = created["metadata"]["resourceVersion"]
    for n in range(3):
        await cluster.client.patch(
            deploy_path(namespace, "w"), {"metadata": {"labels": {"n": str(n)}}}
        )
    await cluster.forget_history()
    assert cluster.client.session is not None
    params = {"watch": "true", "timeoutSeconds": "2", "resourceVersion": since}
    async with cluster.client.session.get(
        f"/apis/apps/v1/namespaces/{namespace}/deployments", params=params,
        timeout=aiohttp.ClientTimeout(total=10),
    ) as response:  # fmt: skip
        assert response.status == 200  # the error comes in the stream
        event = json.loads(await response.content.readline())
    assert event["type"] == "ERROR"
    assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")


async def test_the_operator_relists_after_410_expired_and_goes_on_reconciling(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    operator = OperatorProcess(
        cluster.kubeconfig, namespace, tmp_path, verbose=True,
        extra_env={"MODELSTAGE_OPERATOR_WATCH_SERVER_TIMEOUT": "2"},
    )  # fmt: skip
    await operator.start()
    try:
        await apply(cluster, namespace, SPEC)
        await wait_job(cluster, namespace, digest_of(SPEC))
        await cluster.forget_history()

        async def restarted() -> bool:  # a watch resumed (its 2 s timeout) into the gap
            return "Restarting the watch-stream" in operator.logs()

        await eventually(restarted, timeout=30, what="kopf restarting a watch after 410")
        if cluster.fake is not None:
            assert cluster.fake.expired_watches >= 1
        edited = merged(SPEC, {"dtype": "float16"})
        await cluster.client.patch(md_path(namespace, MD), {"spec": {"dtype": "float16"}})
        await wait_job(cluster, namespace, digest_of(edited))
    finally:
        await operator.stop(graceful=False)
