"""Azurite (the Azure Storage emulator) on 127.0.0.1 for the session, one container per test.

Azurite is installed by ``scripts/setup`` (``scripts/azurite``, from npm); where npm cannot
fetch it these tests are skipped, saying so.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from support.azurite import Azurite, azurite, require_azurite

_containers = itertools.count()


@pytest.fixture(scope="session")
def az(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    require_azurite()
    with azurite(tmp_path_factory.mktemp("azurite")) as server:
        yield server


@pytest.fixture
def container(az: Azurite) -> str:
    """A new, empty container."""
    name = f"ms-{os.getpid()}-{next(_containers)}"
    az.container(name)
    return name


@pytest.fixture(scope="session")
def multiblock_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint whose rank files span several 1 MiB blocks at TP=2 (~29 MB of
    float32 weights in three source files, q/k/v and gate/up spread across them)."""
    spec = SyntheticModel(
        hidden_size=512, intermediate_size=1536, num_layers=2, vocab_size=4000, num_shards=3,
        split_fused=True,
    )  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("mb") / "ckpt")
