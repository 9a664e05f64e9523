"""Scale-out staging to an S3 prefix: four workers + finalize == one stager, object for object."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.errors import ArtifactError
from modelstage.core.location import open_artifact, verify
from modelstage.core.manifest import MANIFEST, TIMING_FIELDS
from modelstage.stager.destinations.s3 import S3Destination
from modelstage.stager.scale_out import Group, finalize, stage_group
from modelstage.stager.stage import StageRequest, stage
from support.s3_server import S3Server

MiB = 1024 * 1024
PART_BYTES = 4 * MiB
"""Several parts per rank of the ~29 MB checkpoint; each part still a multipart upload."""


def _request(src: Path, out: str, s3: S3Server) -> StageRequest:
    return StageRequest(source=str(src), out=out, tp=2, format="runai_streamer_sharded",
                        s3=s3.options(part_bytes=5 * MiB, concurrency=4),
                        max_part_bytes=PART_BYTES)  # fmt: skip


def _objects(s3: S3Server, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [o["Key"] for p in pages for o in p.get("Contents", [])]
    return {k[len(prefix) :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _manifest(raw: bytes) -> dict[str, Any]:
    return {k: v for k, v in json.loads(raw).items() if k not in TIMING_FIELDS}


def test_four_workers_and_finalize_write_the_objects_one_stager_writes(
    s3: S3Server, bucket: str, multipart_ckpt: Path
) -> None:
    stage(_request(multipart_ckpt, f"s3://{bucket}/one/", s3))
    out = f"s3://{bucket}/four/"
    with ThreadPoolExecutor(4) as pool:  # the workers run at once, as the Indexed Job's pods
        groups = list(pool.map(lambda i: stage_group(_request(multipart_ckpt, out, s3),
                                                     Group(i, 4)), range(4)))  # fmt: skip
    assert S3Destination(out, s3.options()).existing() is None, "no manifest before finalize"
    summary = finalize(_request(multipart_ckpt, out, s3))
    assert not summary["alreadyStaged"] and sum(int(g["files"]) for g in groups) > 4

    one, four = _objects(s3, bucket, "one/"), _objects(s3, bucket, "four/")
    assert set(four) == set(one) and len([n for n in one if "-part-" in n]) > 4
    assert {n: b for n, b in four.items() if n != MANIFEST} == {
        n: b for n, b in one.items() if n != MANIFEST
    }
    assert _manifest(four[MANIFEST]) == _manifest(one[MANIFEST])
    verify(open_artifact(out, s3.options()), hash_content=True)


def test_finalize_refuses_a_missing_part_object_and_writes_no_manifest(
    s3: S3Server, bucket: str, multipart_ckpt: Path
) -> None:
    out = f"s3://{bucket}/art/"
    for i in range(2):
        stage_group(_request(multipart_ckpt, out, s3), Group(i, 2))
    s3.client().delete_object(Bucket=bucket, Key="art/model-rank-1-part-2.safetensors")
    with pytest.raises(ArtifactError, match=r"model-rank-1-part-2\.safetensors is missing"):
        finalize(_request(multipart_ckpt, out, s3))
    assert S3Destination(out, s3.options()).existing() is None

    redo = stage_group(_request(multipart_ckpt, out, s3), Group(1, 2))  # rewrites only that one
    assert redo["files"] > 0
    finalize(_request(multipart_ckpt, out, s3))
    verify(open_artifact(out, s3.options()), hash_content=True)


def test_finalize_refuses_a_part_object_not_written_by_this_run(
    s3: S3Server, bucket: str, multipart_ckpt: Path
) -> None:
    out = f"s3://{bucket}/art/"
    for i in range(2):
        stage_group(_request(multipart_ckpt, out, s3), Group(i, 2))
    key = "art/model-rank-0-part-0.safetensors"
    size = len(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    s3.client().put_object(Bucket=bucket, Key=key, Body=b"\0" * size)  # same size, foreign
    with pytest.raises(ArtifactError, match=r"model-rank-0-part-0\.safetensors.*not written by"):
        finalize(_request(multipart_ckpt, out, s3))
    assert S3Destination(out, s3.options()).existing() is None
