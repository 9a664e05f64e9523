"""Fixtures of the node cache tests: a small staged artifact (several hash chunks per file, two
ranks, several files per rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage
from support.kube_cluster import Cluster
from support.node_agent import CHUNK


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


# The live tier's API server (the real control plane when KUBEBUILDER_ASSETS is set, else
# kmock) with node caching's APIs (``support.node_cluster``).
from operator_live.conftest import node_cache_cluster, real_control_plane  # noqa: E402

__all__ = ["node_cache_cluster", "real_control_plane"]


@pytest.fixture
def cluster(node_cache_cluster: Cluster) -> Cluster:
    """The ModelDeployment and NodeCache APIs served; Node objects can be created."""
    return node_cache_cluster
