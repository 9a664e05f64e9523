"""Fixtures of the plugin's tests: small staged artifacts (the serving tier stages its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.serving import LLAMA_TP2, Artifact, stage_artifact


@pytest.fixture(scope="session")
def tied_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tied")


@pytest.fixture(scope="session")
def llama_tp2(tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    return stage_artifact(tmp_path_factory.mktemp("llama"), LLAMA_TP2, 2)
