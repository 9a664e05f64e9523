"""An engine cache under an S3 prefix: ``prepare`` downloads it, verifies the copy chunk by
chunk and places it; an object changed in the bucket is refused (SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from modelstage.core.engine_cache import EngineCacheManifest
from modelstage.core.engine_key import EngineArgs, HardwareClass, ServingConfig, key_factors
from modelstage.core.errors import ModelstageError
from modelstage.stager.engine_capture import engine_cache_target, write_engine_cache
from modelstage.stager.engine_place import place_engine_cache
from support.s3_server import S3Server

FILES = {
    "inductor/zw/czwcq5kk7vsj4kplv6t7wviad6bihx.main.so": os.urandom(9 * 1024 * 1024 + 17),
    "vllm/torch_compile_cache/abc/rank_0_0/model": b"m" * 4096,
}
CONFIG = ServingConfig("0.32.0", "2.13.0+cpu", "/models/a", EngineArgs(maxModelLen=64))
FACTORS = key_factors("d" * 20, CONFIG, HardwareClass("cpu", arch="x86_64", isa=("avx2",)))


def upload(s3: S3Server, bucket: str, tmp: Path) -> str:
    cache = tmp / "cache"
    for name, data in FILES.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    write_engine_cache(cache, FACTORS, 1.0, 2.0)
    client = s3.client()
    for path in cache.rglob("*"):
        if path.is_file():
            key = f"caches/one/{path.relative_to(cache).as_posix()}"
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    return f"s3://{bucket}/caches/one/"


def test_an_s3_engine_cache_is_downloaded_verified_and_placed(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    uri = upload(s3, bucket, tmp_path)
    verdict = place_engine_cache(uri, tmp_path / "pod", FACTORS, s3.options())
    assert verdict["result"] == "hit", verdict
    placed = {
        p.relative_to(tmp_path / "pod").as_posix(): p.read_bytes()
        for p in (tmp_path / "pod").rglob("*")
        if p.is_file()
    }
    assert placed == FILES


def test_an_object_changed_in_the_bucket_is_refused(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    uri = upload(s3, bucket, tmp_path)
    name = "inductor/zw/czwcq5kk7vsj4kplv6t7wviad6bihx.main.so"
    data = bytearray(FILES[name])
    data[len(data) - 3] ^= 0x40  # in the last chunk
    s3.client().put_object(Bucket=bucket, Key=f"caches/one/{name}", Body=bytes(data))
    verdict = place_engine_cache(uri, tmp_path / "pod", FACTORS, s3.options())
    assert verdict["result"] == "corrupt"
    assert "chunk 0 (bytes 0-" in verdict["reason"]  # one 32 MiB chunk
    assert not any(p.is_file() for p in (tmp_path / "pod").rglob("*"))


def written(tmp: Path) -> tuple[Path, EngineCacheManifest]:
    cache = tmp / "work"
    for name, data in FILES.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    return cache, write_engine_cache(cache, FACTORS, 1.0, 2.0)


def test_a_capture_published_to_s3_is_complete_once_its_manifest_is_there(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    """capture-engine-cache --out s3://...: the files, then the manifest; prepare hits it."""
    uri = f"s3://{bucket}/artifacts/ns/d.engine-k/"
    target = engine_cache_target(uri, s3.options())
    assert target.existing() is None
    work, manifest = written(tmp_path)
    target.publish(work, manifest)
    found = engine_cache_target(uri, s3.options()).existing()
    assert found is not None and found.key == manifest.key
    verdict = place_engine_cache(uri, tmp_path / "pod", FACTORS, s3.options())
    assert verdict["result"] == "hit", verdict


def test_an_upload_that_fails_midway_leaves_no_manifest(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/artifacts/ns/d.engine-k/"
    work, manifest = written(tmp_path)
    last = sorted(manifest.files)[-1]
    (work / last).unlink()  # the fault: the second of two uploads fails
    with pytest.raises(ModelstageError):
        engine_cache_target(uri, s3.options()).publish(work, manifest)
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == [f"artifacts/ns/d.engine-k/{sorted(manifest.files)[0]}"], "the first landed"
    assert engine_cache_target(uri, s3.options()).existing() is None
    verdict = place_engine_cache(uri, tmp_path / "pod", FACTORS, s3.options())
    assert verdict["result"] == "absent", verdict
