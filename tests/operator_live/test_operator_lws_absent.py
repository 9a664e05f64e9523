"""The operator where the LeaderWorkerSet API is not installed: it watches leaderworkersets
(the chart grants it), and must serve everything else all the same, never exit.

On the real tier the control plane is shared by the session: an earlier test may have
installed the LeaderWorkerSet CRD, so this module's cluster removes it before the operator
starts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from support.kube_cluster import Cluster, ControlPlane, eventually, kmock_cluster, real_cluster
from support.leaderworkerset import KIND, LWS, LWS_CRD
from support.modelstage_objects import SPEC, md_path, merged, model_deployment
from support.operator_flow import MD, condition, staged_and_rolled, status_of
from support.operator_process import OperatorProcess

from .conftest import CRD, PEERING_CRDS

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
CRDS_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@pytest_asyncio.fixture
async def cluster(
    real_control_plane: ControlPlane | None, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """The cluster without the LeaderWorkerSet API."""
    if real_control_plane is None:
        async with kmock_cluster([CRD, *PEERING_CRDS], tmp_path) as fake_cluster:
            yield fake_cluster
        return
    async with real_cluster(real_control_plane, [CRD, *PEERING_CRDS], tmp_path) as real:
        name = LWS_CRD["metadata"]["name"]
        if await real.client.get(f"{CRDS_PATH}/{name}") is not None:
            await real.client.delete(f"{CRDS_PATH}/{name}")

        async def gone() -> bool:
            served = await real.client.get(f"/apis/{KIND.api_version}")
            return served is None and await real.client.get(f"{CRDS_PATH}/{name}") is None

        await eventually(gone, timeout=60, what="the LeaderWorkerSet API removed")
        yield real


async def test_without_the_leaderworkerset_api_the_operator_serves_the_rest(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await staged_and_rolled(cluster, namespace, SPEC)
    assert "Unresolved resources cannot be served" in operator.logs()
    assert "leaderworkersets" in operator.logs()

    target = {"serving": {"targetRef": {"kind": "LeaderWorkerSet", "name": LWS}}}
    await cluster.client.create(
        md_path(namespace), model_deployment("multi-node", merged(SPEC, target))
    )

    async def not_found() -> bool:
        degraded = condition(await status_of(cluster, namespace, "multi-node"), "Degraded")
        return degraded.get("reason") == "TargetNotFound"

    await eventually(not_found, what="TargetNotFound for the LeaderWorkerSet")
    assert (await status_of(cluster, namespace, MD))["phase"] == "Ready"
    assert operator.process is not None and operator.process.poll() is None
