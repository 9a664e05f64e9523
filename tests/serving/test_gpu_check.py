"""Smoke test of ``e2e/gpu_check.py`` in its reduced CPU mode, with a tiny artifact.

The script runs on a GPU machine where nothing is installed, so it is started here with
``-S`` and an empty ``PYTHONPATH`` entry for modelstage: it must find the project source by
itself. Its figures are not checked (this machine's two cores are shared); its result is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "e2e" / "gpu_check.py"


def test_gpu_check_runs_without_an_installed_modelstage_and_agrees_with_stock(
    pod_site: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELSTAGE_", "PYTHON"))}
    env |= {"PYTHONPATH": str(pod_site)}
    proc = subprocess.run(
        [sys.executable, "-S", str(SCRIPT), "--size-gib", "0.07", "--chunk-mib", "4",
         "--dir", str(tmp_path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["plugin_equals_stock"] is True
    # plugin_verified: every byte hashed as it lands (blake3 is in the pod's site here)
    assert set(summary["gb_per_s"]) == {"ceiling", "raw_read", "stock", "plugin", "plugin_verified"}
    assert all(rate > 0 for rate in summary["gb_per_s"].values())
    assert summary["bytes"] >= 2 * 4096 * 4096 * 2
    assert list(tmp_path.iterdir()) == []  # the artifact is removed


@pytest.mark.slow
def test_gpu_check_startup_captures_places_and_hits_the_compile_cache(
    pod_site: Path, tmp_path: Path
) -> None:
    """``--startup`` in reduced mode: torch.compile on the CPU (inductor's C++ kernels)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELSTAGE_", "PYTHON"))}
    env |= {"PYTHONPATH": str(pod_site)}
    proc = subprocess.run(
        [sys.executable, "-S", str(SCRIPT), "--size-gib", "0.07", "--chunk-mib", "4",
         "--dir", str(tmp_path), "--startup", "--layers", "1"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    startup = json.loads(proc.stdout.strip().splitlines()[-1])["startup"]
    assert startup["placed"] == "hit" and startup["hit"] is True, startup
    assert startup["outputs_equal"] is True
    assert startup["compile_ratio"] < 0.5, startup
    assert list(tmp_path.iterdir()) == []
