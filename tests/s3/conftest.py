"""A real S3 server (SeaweedFS on 127.0.0.1) for the session, one fresh bucket per test.

The credentials are long and distinctive so that a test can grep every output for them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint


@pytest.fixture(scope="session")
def multipart_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint whose rank files exceed one 5 MiB part even at TP=2 (~29 MB of
    float32 weights in three source files, q/k/v and gate/up spread across them)."""
    spec = SyntheticModel(
        hidden_size=512, intermediate_size=1536, num_layers=2, vocab_size=4000, num_shards=3,
        split_fused=True,
    )  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("mp") / "ckpt")


@pytest.fixture
def make_small_ckpt(tmp_path: Path) -> Path:
    """A fresh tiny Llama checkpoint (one file, well under one part) that a test may edit."""
    return write_checkpoint(SyntheticModel(), tmp_path / "small")


@pytest.fixture(scope="session")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~200 MB of float32 weights: long enough an upload to kill the stager in the middle."""
    spec = SyntheticModel(hidden_size=1024, intermediate_size=4096, num_layers=3,
                          vocab_size=8000, num_shards=2)  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("big") / "ckpt")
