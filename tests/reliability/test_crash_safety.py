"""Crash safety of the stager: SIGKILL at 20+ points spread over a run, local and S3.

After every kill nothing looks complete: ``modelstage verify`` fails, there is no manifest,
and the serving initContainer's check (``prepare.verify_artifact``, the gate before any
rollout) refuses the location. A rerun then produces an artifact that verifies and is
byte-identical to an uninterrupted run: every rank file, and the manifest apart from its
timing fields. Kill points are byte offsets (bytes the stager has written, files and sockets
alike), from "still importing" to "95% written", see killer.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.errors import ModelstageError
from modelstage.core.location import open_artifact, verify, verify_directory
from modelstage.core.manifest import MANIFEST, TIMING_FIELDS
from modelstage.stager import cli
from modelstage.stager.destinations.s3 import S3Destination
from modelstage.stager.prepare import verify_artifact
from modelstage.stager.stage import StageRequest, stage
from support.fault_proxy import fault_proxy
from support.killer import Kill, kill_after_writing
from support.s3_server import S3Server

KILL_POINTS = 24
LAST_FRACTION = 0.95
"""Kill points stop at 95% of the bytes: one slice later the run may already have finished."""
ATTEMPTS = 3
"""Tries per kill point: on a busy machine the harness may wake up after the run finished."""


def thresholds(total: int, points: int) -> list[int]:
    """``points`` byte offsets from 0 (during start-up) to LAST_FRACTION of ``total``."""
    return [int(total * LAST_FRACTION * i / (points - 1)) for i in range(points)]


def modelstage_cmd(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("modelstage")), *args]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_EC2_METADATA_DISABLED": "true"}


def without_timing(manifest_json: bytes | str) -> dict[str, Any]:
    return {k: v for k, v in json.loads(manifest_json).items() if k not in TIMING_FIELDS}


def local_tree(directory: Path) -> dict[str, str]:
    """{file name: sha256 of its bytes} for every file of an artifact directory but the
    manifest (compared apart from timing)."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.name != MANIFEST
    }


def assert_spread(kills: list[Kill], total: int, *, buckets: int = 12) -> None:
    """The kills really happened at distinct points: one before any byte was written, the
    others over at least ``buckets`` of 20 equal byte ranges, none after the run had
    finished by itself."""
    assert all(k.written >= 0 for k in kills), "a run finished before its kill point"
    assert min(k.written for k in kills) < total * 0.01
    assert max(k.written for k in kills) > total * 0.9
    assert len({k.written * 20 // total for k in kills}) >= buckets, [k.written for k in kills]


def test_local_stage_killed_at_24_points_never_looks_complete_and_reruns_byte_identical(
    crash_ckpt: Path, tmp_path: Path
) -> None:
    reference = tmp_path / "reference"
    summary = stage(StageRequest(source=str(crash_ckpt), out=str(reference), tp=2))
    total = int(summary["bytes"])
    expected_files = local_tree(reference)
    expected_manifest = without_timing((reference / MANIFEST).read_bytes())

    kills = []
    for i, threshold in enumerate(thresholds(total, KILL_POINTS)):
        for attempt in range(ATTEMPTS):  # another try only if the run outran the harness
            out = tmp_path / f"a{i}-{attempt}" / "artifact"
            kill = kill_after_writing(
                modelstage_cmd("stage", str(crash_ckpt), "--tp", "2", "--out", str(out)),
                threshold, env=child_env(), log=tmp_path / f"kill-{i}-{attempt}.log",
            )  # fmt: skip
            if kill.written >= 0:
                break
        kills.append(kill)
        assert kill.returncode == -9, kill.log
        where = f"kill {i} at {kill.written} of {total} bytes"
        assert not out.exists(), where  # the one rename is the commit
        assert cli.main(["verify", str(out)]) == 1, where
        with pytest.raises(ModelstageError):
            verify_artifact(str(out), digest=summary["digest"], tp=2, hash_content=False)

        rerun = stage(StageRequest(source=str(crash_ckpt), out=str(out), tp=2))
        assert rerun["alreadyStaged"] is False and rerun["digest"] == summary["digest"]
        verify_directory(out, digest=summary["digest"], tp=2)
        assert local_tree(out) == expected_files, where
        assert without_timing((out / MANIFEST).read_bytes()) == expected_manifest, where
        assert not list(out.parent.glob("artifact.tmp-*")), f"{where}: work directory left"
    assert_spread(kills, total)


def s3_objects(s3: S3Server, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [o["Key"] for p in pages for o in p.get("Contents", [])]
    return {
        k[len(prefix) :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys
    }


def s3_cli_args(s3: S3Server, endpoint: str | None = None) -> list[str]:
    return ["--s3-endpoint", endpoint or s3.endpoint, "--s3-path-style", "--s3-region", s3.region,
            "--s3-credentials-file", str(s3.credentials_file)]  # fmt: skip


def s3_request(src: Path, out: str, s3: S3Server) -> StageRequest:
    return StageRequest(source=str(src), out=out, tp=2, format="runai_streamer_sharded",
                        s3=s3.options())  # fmt: skip




@pytest.mark.parametrize(
    "points", [5, pytest.param(20, marks=pytest.mark.slow, id="20-slow")]
)  # about 6 s per point: the default tier kills at 5, the slow tier at 20 (~2 minutes)
def test_s3_stage_killed_at_many_points_never_looks_complete_and_reruns_byte_identical(
    crash_ckpt: Path, s3: S3Server, bucket: str, tmp_path: Path, points: int
) -> None:
    summary = stage(s3_request(crash_ckpt, f"s3://{bucket}/reference/", s3))
    total = int(summary["bytes"])
    reference = s3_objects(s3, bucket, "reference/")
    expected_manifest = without_timing(reference.pop(MANIFEST))

    kills = []
    for i, threshold in enumerate(thresholds(total, points)):
        for attempt in range(ATTEMPTS):  # another try only if the run outran the harness
            prefix = f"run{i}-{attempt}/"
            out = f"s3://{bucket}/{prefix}"
            with fault_proxy(s3.endpoint) as proxy:  # counts the bytes that reach the server
                kill = kill_after_writing(
                    modelstage_cmd("stage", str(crash_ckpt), "--tp", "2", "--format",
                                   "runai_streamer_sharded", "--out", out,
                                   *s3_cli_args(s3, proxy.endpoint)),
                    threshold, env=child_env(), log=tmp_path / f"kill-{i}-{attempt}.log",
                    progress=lambda _pid, p=proxy: p.bytes_up,
                )  # fmt: skip
            if kill.written >= 0:
                break
        kills.append(kill)
        where = f"kill {i} at {kill.written} of {total} bytes"
        assert kill.returncode == -9, kill.log
        assert MANIFEST not in s3_objects(s3, bucket, prefix), where
        assert S3Destination(out, s3.options()).existing() is None, where
        assert cli.main(["verify", out, *s3_cli_args(s3)]) == 1, where
        with pytest.raises(ModelstageError):
            verify_artifact(out, digest=summary["digest"], tp=2, hash_content=False,
                            s3=s3.options())  # fmt: skip

        rerun = stage(s3_request(crash_ckpt, out, s3))
        assert rerun["alreadyStaged"] is False and rerun["digest"] == summary["digest"]
        verify(open_artifact(out, s3.options()), digest=summary["digest"], tp=2)
        staged = s3_objects(s3, bucket, prefix)
        assert without_timing(staged.pop(MANIFEST)) == expected_manifest, where
        assert staged.keys() == reference.keys(), where
        for name, data in reference.items():
            assert staged[name] == data, f"{where}: {name} differs"
    uploads = s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert not uploads, "a rerun left a killed run's multipart upload behind"
    assert_spread(kills, total, buckets=12 if points >= 20 else points - 1)
