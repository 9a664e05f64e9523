"""The S3 source against a real S3 server (SeaweedFS on 127.0.0.1): staged rank files equal
staging from local disk byte for byte, reads are exactly the asked ranges fetched in parallel,
the objects' ETags pin the content, and errors are one line without credentials."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.errors import CheckpointError
from modelstage.core.manifest import MANIFEST
from modelstage.stager.sources import open_source
from modelstage.stager.sources.s3 import S3Source
from modelstage.stager.stage import StageRequest, stage
from support.s3_server import ACCESS_KEY, SECRET_KEY, S3Server

KiB = 1024


def upload(s3: S3Server, bucket: str, prefix: str, folder: Path) -> None:
    client = s3.client()
    for path in sorted(folder.iterdir()):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())


def artifact_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != MANIFEST}


@pytest.mark.parametrize("tp", [2, 4])
def test_staging_from_s3_writes_the_same_bytes_as_staging_from_local_disk(
    s3: S3Server, bucket: str, split_ckpt: Path, tmp_path: Path, tp: int
) -> None:
    upload(s3, bucket, "llama", split_ckpt)
    stage(StageRequest(source=str(split_ckpt), out=str(tmp_path / "local"), tp=tp))
    summary = stage(StageRequest(source=f"s3://{bucket}/llama", out=str(tmp_path / "remote"),
                                 tp=tp, s3=s3.options()))  # fmt: skip

    local, remote = artifact_files(tmp_path / "local"), artifact_files(tmp_path / "remote")
    assert sorted(remote) == sorted(local)
    assert sum(n.startswith("model-rank-") for n in remote) == tp
    for name, data in local.items():
        assert remote[name] == data, name
    manifest = json.loads((tmp_path / "remote" / MANIFEST).read_text())
    local_manifest = json.loads((tmp_path / "local" / MANIFEST).read_text())
    assert manifest["files"] == local_manifest["files"]

    source = manifest["source"]
    assert source["kind"] == "s3" and source["location"] == f"s3://{bucket}/llama/"
    assert source["uri"] == summary["source"] == f"s3://{bucket}/llama"  # as requested
    client = s3.client()
    for entry in source["files"]:
        head = client.head_object(Bucket=bucket, Key=f"llama/{entry['name']}")
        assert entry["etag"] == head["ETag"].strip('"')
        assert entry["size"] == head["ContentLength"] == (split_ckpt / entry["name"]).stat().st_size
    assert {e["name"] for e in source["files"]} >= {
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors", "config.json", "tokenizer.json",
    }  # fmt: skip
    assert summary["sourceIdentity"].startswith("sha256:")


def test_a_large_read_is_split_into_concurrent_ranged_gets_of_exactly_the_asked_bytes(
    s3: S3Server, bucket: str
) -> None:
    data = os.urandom(1100 * KiB)
    s3.client().put_object(Bucket=bucket, Key="m/blob.safetensors", Body=data)
    source = S3Source(f"s3://{bucket}/m", s3.options(concurrency=4), range_bytes=256 * KiB)
    ranges: list[str] = []
    barrier: list[threading.Barrier] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        ranges.append(params["Range"])
        if barrier:  # every piece must be in flight at once, or this times out and fails
            barrier[0].wait(timeout=30)

    source.s3.client.meta.events.register("provide-client-params.s3.GetObject", record)
    try:
        small = bytearray(1000)
        source.read_range("blob.safetensors", 77, memoryview(small))
        assert bytes(small) == data[77:1077] and ranges == ["bytes=77-1076"]

        ranges.clear()
        barrier.append(threading.Barrier(4))
        offset, length = 123, 4 * 256 * KiB - 500
        big = bytearray(length)
        source.read_range("blob.safetensors", offset, memoryview(big))
        assert bytes(big) == data[offset : offset + length]
    finally:
        source.close()
    spans = sorted(tuple(int(x) for x in r.removeprefix("bytes=").split("-")) for r in ranges)
    assert len(spans) == 4 and all(b - a + 1 <= 256 * KiB for a, b in spans)
    assert spans[0][0] == offset and spans[-1][1] == offset + length - 1
    assert all(spans[i][1] + 1 == spans[i + 1][0] for i in range(3)), "gaps or overlaps"


def test_an_object_replaced_after_listing_fails_instead_of_mixing_two_contents(
    s3: S3Server, bucket: str
) -> None:
    client = s3.client()
    client.put_object(Bucket=bucket, Key="m/w.safetensors", Body=b"a" * 4096)
    source = S3Source(f"s3://{bucket}/m", s3.options())
    try:
        client.put_object(Bucket=bucket, Key="m/w.safetensors", Body=b"b" * 4096)
        with pytest.raises(CheckpointError, match="changed while staging"):
            source.read_range("w.safetensors", 0, memoryview(bytearray(16)))
    finally:
        source.close()


def test_a_read_past_the_end_of_an_object_names_the_truncated_object(
    s3: S3Server, bucket: str
) -> None:
    s3.client().put_object(Bucket=bucket, Key="m/w.safetensors", Body=b"x" * 100)
    source = S3Source(f"s3://{bucket}/m", s3.options())
    try:
        with pytest.raises(CheckpointError, match=r"w\.safetensors: object ends at byte 100"):
            source.read_range("w.safetensors", 90, memoryview(bytearray(20)))
    finally:
        source.close()


def test_an_empty_prefix_is_one_clear_error(s3: S3Server, bucket: str) -> None:
    with pytest.raises(CheckpointError, match="no objects under this prefix"):
        open_source(f"s3://{bucket}/nothing-here", s3=s3.options())


def test_wrong_credentials_fail_with_one_line_that_holds_no_secret(
    s3: S3Server, bucket: str, split_ckpt: Path, tmp_path: Path
) -> None:
    upload(s3, bucket, "llama", split_ckpt)
    wrong = tmp_path / "wrong"
    wrong.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                     "aws_secret_access_key = not-the-secret-Gannet-99\n")  # fmt: skip
    with pytest.raises(CheckpointError) as err:
        open_source(f"s3://{bucket}/llama", s3=s3.options(credentials_file=str(wrong)))
    message = str(err.value)
    assert "SignatureDoesNotMatch" in message and "\n" not in message
    assert "not-the-secret-Gannet-99" not in message and SECRET_KEY not in message


def test_cli_stages_from_s3_and_reports_the_source_identity_without_leaking_credentials(
    s3: S3Server, bucket: str, split_ckpt: Path, tmp_path: Path
) -> None:
    upload(s3, bucket, "llama", split_ckpt)
    out = tmp_path / "art"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    result = subprocess.run(
        [str(Path(sys.executable).with_name("modelstage")), "stage", f"s3://{bucket}/llama",
         "--tp", "2", "--out", str(out), "--s3-endpoint", s3.endpoint, "--s3-path-style",
         "--s3-credentials-file", str(s3.credentials_file)],
        env=env, cwd="/", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    manifest = json.loads((out / MANIFEST).read_text())
    assert summary["source"] == f"s3://{bucket}/llama"
    assert summary["sourceIdentity"].startswith("sha256:") and manifest["source"]["kind"] == "s3"
    for text in (result.stdout, result.stderr, (out / MANIFEST).read_text()):
        assert SECRET_KEY not in text and ACCESS_KEY not in text


def test_an_object_replaced_under_the_same_key_is_a_new_artifact(
    s3: S3Server, bucket: str, split_ckpt: Path, tmp_path: Path
) -> None:
    """Retrained weights uploaded over the old keys: same names and sizes, new ETags."""
    from modelstage.core.errors import ArtifactError
    from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint

    upload(s3, bucket, "moving", split_ckpt)
    request = StageRequest(source=f"s3://{bucket}/moving", out=str(tmp_path / "art"), tp=2,
                           s3=s3.options())  # fmt: skip
    first = stage(request)
    assert stage(request)["alreadyStaged"] is True
    retrained = write_checkpoint(SyntheticModel(num_shards=3, split_fused=True, seed=9),
                                 tmp_path / "retrained")  # fmt: skip
    upload(s3, bucket, "moving", retrained)
    with pytest.raises(ArtifactError, match="the source changed since that artifact was staged"):
        stage(request)
    second = stage(StageRequest(source=f"s3://{bucket}/moving", out=str(tmp_path / "new"),
                                tp=2, s3=s3.options()))  # fmt: skip
    assert second["digest"] != first["digest"]
    assert second["sourceIdentity"] != first["sourceIdentity"]


@pytest.mark.parametrize("fmt", ["safetensors", "runai_streamer"])
def test_a_quantized_gemma2_from_s3_is_cached_in_the_hugging_face_layout(
    s3: S3Server, bucket: str, split_ckpt: Path, tmp_path: Path, fmt: str
) -> None:
    """Any architecture and quantization, read from an S3 source as from a folder: the
    artifact is its objects byte for byte, config.json with its quantization_config included."""
    src = tmp_path / "gemma"
    src.mkdir()
    for path in split_ckpt.iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                  quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})  # fmt: skip
    (src / "config.json").write_text(json.dumps(config))
    upload(s3, bucket, "gemma", src)
    out = f"s3://{bucket}/out-{fmt}/" if fmt == "runai_streamer" else str(tmp_path / "out")
    summary = stage(StageRequest(source=f"s3://{bucket}/gemma", out=out, tp=2, format=fmt,
                                 s3=s3.options()))  # fmt: skip
    assert summary["format"] == fmt and summary["sourceIdentity"].startswith("sha256:")
    if fmt == "runai_streamer":
        client = s3.client()
        got = {name: client.get_object(Bucket=bucket, Key=f"out-{fmt}/{name}")["Body"].read()
               for name in (p.name for p in src.iterdir())}  # fmt: skip
    else:
        got = artifact_files(tmp_path / "out")
    assert got == {p.name: p.read_bytes() for p in src.iterdir()}
