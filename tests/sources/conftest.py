"""Fixtures for the source tests: a real S3 server, a loopback hub, checkpoints to serve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from support.hub_server import FakeHub, fake_hub

HF_TOKEN = "hf_MsTestToken9Kestrel4Lantern2Fjord"
"""Long and distinctive, so that a test can grep every output for them."""


@pytest.fixture(scope="session")
def split_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint in three files whose q/k/v and gate/up tensors sit in different
    files (objects), so one fused rank tensor is assembled from several sources."""
    spec = SyntheticModel(num_shards=3, split_fused=True)
    return write_checkpoint(spec, tmp_path_factory.mktemp("split") / "ckpt")


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with fake_hub(HF_TOKEN) as server:
        yield server
