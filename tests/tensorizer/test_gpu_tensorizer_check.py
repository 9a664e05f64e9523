"""e2e/gpu_tensorizer_check.py where it cannot run (no CUDA here): it must say why, and fail
only when asked to require a GPU; its vLLM runner must at least be valid Python."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "e2e" / "gpu_tensorizer_check.py"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, env={},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the check itself")
def test_without_a_gpu_it_reports_why_and_fails_only_when_required(tmp_path: Path) -> None:
    relaxed, required = run(cwd=tmp_path), run("--require", cwd=tmp_path)
    assert relaxed.returncode == 0, relaxed.stderr
    assert required.returncode == 2, required.stderr
    line = json.loads(relaxed.stdout.strip().splitlines()[-1])
    assert line["check"] == "tensorizer" and "CUDA" in line["skipped"]


def test_its_vllm_runner_parses_and_points_vllm_at_the_per_rank_files() -> None:
    source = SCRIPT.read_text()
    module = ast.parse(source)
    runner = next(
        n.value.value for n in module.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "RUNNER"
        and isinstance(n.value, ast.Constant)
    )  # fmt: skip
    ast.parse(runner)
    assert '"tensorizer_uri": f"{artifact}/model-rank-%03d.tensors"' in source
