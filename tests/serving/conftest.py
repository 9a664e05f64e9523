"""Session fixtures for the serving side: staged artifacts and a pod-like site directory."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from modelstage.stager.synthetic import SyntheticModel
from support.serving import Artifact, stage_artifact


@pytest.fixture(scope="session")
def tied_tp1(tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    """Tied embeddings: the artifact holds ``lm_head`` only (vLLM's sharded layout)."""
    spec = SyntheticModel(tie_word_embeddings=True, num_shards=2, split_fused=True)
    return stage_artifact(tmp_path_factory.mktemp("tied"), spec, 1)


@pytest.fixture(scope="session")
def llama_tp2(tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    spec = SyntheticModel(num_shards=2, split_fused=True, seed=3)
    return stage_artifact(tmp_path_factory.mktemp("llama"), spec, 2)


@pytest.fixture(scope="session")
def pod_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The venv's site-packages as a stock vLLM image has it: every entry but modelstage's.

    A folder of symlinks (cheap, and the real packages stay where their shared libraries
    expect them); with ``python -S`` it is the only site directory on ``sys.path``.
    """
    real = Path(sysconfig.get_paths()["purelib"])
    site = tmp_path_factory.mktemp("pod") / "site-packages"
    site.mkdir()
    for entry in real.iterdir():
        name = entry.name
        if name.startswith(("modelstage", "__editable__")) or name.endswith(".pth"):
            continue
        (site / name).symlink_to(entry)
    return site
