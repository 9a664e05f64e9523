"""Fixtures of the live operator tests: a Kubernetes API (real control plane when
``KUBEBUILDER_ASSETS`` provides one, else kmock), a namespace, and the operator process."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from support import node_cluster
from support.kube_cluster import (
    Cluster,
    ControlPlane,
    assets_folder,
    control_plane,
    kmock_cluster,
    new_namespace,
    real_cluster,
)
from support.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
CRD: dict[str, Any] = yaml.safe_load(
    (ROOT / "crds" / "modelstage.io_modeldeployments.yaml").read_text()
)
PEERING_CRDS: list[dict[str, Any]] = [
    d for d in yaml.safe_load_all((ROOT / "crds" / "kopf.dev_peerings.yaml").read_text()) if d
]
"""kopf's peering resources, as the chart installs them (the peering test needs them)."""


@pytest.fixture(scope="session")
def real_control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane | None]:
    assets = assets_folder()
    if assets is None:
        yield None
        return
    with control_plane(assets, tmp_path_factory.mktemp("control-plane")) as plane:
        yield plane


@pytest_asyncio.fixture
async def cluster(
    real_control_plane: ControlPlane | None, tmp_path: Path
) -> AsyncIterator[Cluster]:
    if real_control_plane is None:
        async with kmock_cluster([CRD, *PEERING_CRDS], tmp_path) as fake_cluster:
            yield fake_cluster
        return
    async with real_cluster(real_control_plane, [CRD, *PEERING_CRDS], tmp_path) as real:
        yield real


@pytest_asyncio.fixture
async def node_cache_cluster(
    real_control_plane: ControlPlane | None, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """The cluster with node caching's APIs (``support.node_cluster``); a test module uses it
    as its ``cluster``."""
    async with node_cluster.node_cache_cluster(real_control_plane, tmp_path) as c:
        yield c


@pytest_asyncio.fixture
async def namespace(cluster: Cluster) -> str:
    return await new_namespace(cluster, f"t-{uuid.uuid4().hex[:8]}")


@pytest_asyncio.fixture
async def operator(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> AsyncIterator[OperatorProcess]:
    # verbose: the handlers' event trace is the evidence operator_flow's waits read
    process = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, verbose=True)
    await process.start()
    try:
        yield process
    finally:
        # SIGKILL: graceful shutdown is not under test and kopf's takes seconds.
        await process.stop(graceful=False)
