"""Fixtures of the reliability tier: one checkpoint large enough to kill a stager inside it,
a real S3 server (SeaweedFS on 127.0.0.1) with distinctive credentials to grep for, and a
fresh bucket per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint


@pytest.fixture(scope="session")
def crash_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~65 MB of float32 weights in three files, q/k/v and gate/up spread across them: a
    stage takes a few hundred milliseconds, long enough to stop it at 20+ distinct points."""
    spec = SyntheticModel(hidden_size=512, intermediate_size=1536, num_layers=4,
                          vocab_size=4000, num_shards=3, split_fused=True)  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("crash") / "ckpt")


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama checkpoint, shared read-only."""
    return write_checkpoint(SyntheticModel(), tmp_path_factory.mktemp("small") / "ckpt")


# The live operator tier's fixtures (an API server: the real control plane when
# KUBEBUILDER_ASSETS is set, else the extended kmock; a namespace; the operator process).
from operator_live.conftest import (  # noqa: E402
    cluster,
    namespace,
    operator,
    real_control_plane,
)

__all__ = ["cluster", "namespace", "operator", "real_control_plane"]
