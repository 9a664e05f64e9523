"""Fixtures of the node cache tests: a small staged artifact (several hash chunks per file, two
ranks, several files per rank)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from support.kube_cluster import (
    Cluster,
    ControlPlane,
    assets_folder,
    control_plane,
    kmock_cluster,
    real_cluster,
)
from support.kube_fake import ResourceSpec
from support.node_agent import CHUNK

ROOT = Path(__file__).resolve().parents[2]
MD_CRD: dict[str, Any] = yaml.safe_load(
    (ROOT / "crds" / "modelstage.io_modeldeployments.yaml").read_text()
)
NODE_CACHE_CRD: dict[str, Any] = yaml.safe_load(
    (ROOT / "crds" / "modelstage.io_nodecaches.yaml").read_text()
)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~29 MB of float32 weights: long enough a copy to kill it in the middle."""
    spec = SyntheticModel(hidden_size=512, intermediate_size=1536, num_layers=2,
                          vocab_size=4000, num_shards=2)  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("ckpt") / "ckpt")


@pytest.fixture(scope="session")
def artifact(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TP=2 sharded_state artifact in 256 KiB chunks, each rank in parts of at most 4 MB."""
    out = tmp_path_factory.mktemp("staged") / "artifact"
    stage(StageRequest(source=str(checkpoint), out=str(out), tp=2, chunk_bytes=CHUNK,
                       max_part_bytes=4_000_000))  # fmt: skip
    return out


@pytest.fixture(scope="session")
def real_control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane | None]:
    """The real API server when ``KUBEBUILDER_ASSETS`` names one, else None (kmock)."""
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
    """The ModelDeployment and NodeCache CRDs served; Node objects can be created (kmock
    serves them here; the real API server does anyway)."""
    if real_control_plane is None:
        async with kmock_cluster([MD_CRD, NODE_CACHE_CRD], tmp_path) as fake_cluster:
            fake_cluster.fake.register(ResourceSpec("v1", "nodes", "Node"), namespaced=False)
            yield fake_cluster
        return
    async with real_cluster(real_control_plane, [MD_CRD, NODE_CACHE_CRD], tmp_path) as real:
        yield real
