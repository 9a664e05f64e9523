"""``modelstage delete`` on an S3 prefix: the manifest object first, then every object."""

from __future__ import annotations

from pathlib import Path

import pytest
from modelstage.core.engine_cache import ENGINE_MANIFEST
from modelstage.core.errors import SpecError
from modelstage.stager.delete import delete_artifact
from modelstage.stager.destinations.s3 import S3Destination
from modelstage.stager.stage import StageRequest, stage
from support.s3_server import S3Server

DIGEST = "0123456789abcdef0123"


def test_delete_removes_every_object_of_the_artifact_and_nothing_beside_it(
    s3: S3Server, bucket: str, make_small_ckpt: Path
) -> None:
    uri = f"s3://{bucket}/ns/{DIGEST}"
    for target in (uri, f"s3://{bucket}/ns/{'f' * 20}"):
        stage(StageRequest(source=str(make_small_ckpt), out=target, tp=2,
                           format="runai_streamer_sharded", s3=s3.options(),
                           digest=target.rsplit("/", 1)[-1]))  # fmt: skip
    result = delete_artifact(uri, digest=DIGEST, s3=s3.options())
    assert result["removed"] > 3
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix="ns/")
    keys = [o["Key"] for o in listing.get("Contents", [])]
    assert keys and all(k.startswith(f"ns/{'f' * 20}/") for k in keys)
    assert S3Destination(uri, s3.options()).existing() is None
    assert delete_artifact(uri, s3=s3.options())["removed"] == 0  # idempotent


def test_a_prefix_named_by_the_user_is_deleted_when_its_manifest_matches(
    s3: S3Server, bucket: str, make_small_ckpt: Path
) -> None:
    uri = f"s3://{bucket}/models/llama-tp2/"
    summary = stage(StageRequest(source=str(make_small_ckpt), out=uri, tp=2,
                                 format="runai_streamer_sharded", s3=s3.options()))  # fmt: skip
    with pytest.raises(SpecError, match=f"manifest says artifact {summary['digest']}, not f"):
        delete_artifact(uri, digest="f" * 20, s3=s3.options())
    result = delete_artifact(uri, digest=summary["digest"], s3=s3.options())
    assert result["digest"] == summary["digest"] and result["removed"] > 3
    assert "Contents" not in s3.client().list_objects_v2(Bucket=bucket, Prefix="models/")
    assert delete_artifact(uri, s3=s3.options())["removed"] == 0


def test_the_artifacts_engine_caches_go_with_it_and_no_other(
    s3: S3Server, bucket: str, make_small_ckpt: Path
) -> None:
    uri = f"s3://{bucket}/ns/{DIGEST}"
    stage(StageRequest(source=str(make_small_ckpt), out=uri, tp=2,
                       format="runai_streamer_sharded", s3=s3.options(), digest=DIGEST))  # fmt: skip
    client = s3.client()
    caches = [f"ns/{DIGEST}.engine-{key}/" for key in ("a" * 16, "b" * 16)]
    other = f"ns/{'f' * 20}.engine-{'a' * 16}/"
    for cache in [*caches, other]:
        for name in (ENGINE_MANIFEST, "inductor/x/y.so", "vllm/torch_compile_cache/m"):
            client.put_object(Bucket=bucket, Key=cache + name, Body=b"x")
    delete_artifact(uri, digest=DIGEST, s3=s3.options())
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="ns/")["Contents"]]
    assert sorted(keys) == sorted(other + n for n in (ENGINE_MANIFEST, "inductor/x/y.so",
                                                       "vllm/torch_compile_cache/m"))  # fmt: skip
