"""Session fixtures for the serving side: staged artifacts and a pod-like site directory."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.serving import LLAMA_TP2, TIED, Artifact, stage_artifact, stock_run


@pytest.fixture(scope="session")
def tied_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tied")


@pytest.fixture(scope="session")
def tied_tp1(tied_root: Path) -> Artifact:
    """Tied embeddings: the artifact holds ``lm_head`` only (vLLM's sharded layout)."""
    return stage_artifact(tied_root, TIED, 1)


@pytest.fixture(scope="session")
def tied_runai(tied_root: Path) -> dict[str, Artifact]:
    """The same checkpoint as ``tied_tp1`` in the Run:ai formats and the Hugging Face layout
    copy (``safetensors``), by plugin load format."""
    return {
        f"modelstage_{fmt}": stage_artifact(tied_root, TIED, 1, fmt)
        for fmt in ("runai_streamer_sharded", "runai_streamer", "safetensors")
    }


@pytest.fixture(scope="session")
def stock_results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Artifact], Any]:
    """vLLM's stock ``sharded_state`` result per artifact, computed once per session."""
    cache: dict[Path, Any] = {}

    def get(artifact: Artifact) -> Any:
        if artifact.path not in cache:
            cache[artifact.path] = stock_run(artifact, tmp_path_factory.mktemp("stock"))
        return cache[artifact.path]

    return get


@pytest.fixture(scope="session")
def llama_tp2(tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    return stage_artifact(tmp_path_factory.mktemp("llama"), LLAMA_TP2, 2)


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
