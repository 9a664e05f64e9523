"""Staging to S3 against a real S3 server (SeaweedFS on 127.0.0.1): byte-exact round trips,
per-object content-hash metadata, the manifest as the commit point, reruns that finish what a
killed or failed run left, and credentials that never reach an output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.errors import ArtifactError, SpecError
from modelstage.core.integrity import digest_bytes
from modelstage.core.location import open_artifact, verify
from modelstage.core.manifest import MANIFEST
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager import cli
from modelstage.stager.destinations.s3 import S3Destination
from modelstage.stager.stage import StageRequest, stage
from support.s3_server import S3Server

MiB = 1024 * 1024


def objects(s3: S3Server, bucket: str, prefix: str) -> dict[str, dict[str, Any]]:
    """{name under prefix: listing entry} with a plain boto3 client."""
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix) :]: o for p in pages for o in p.get("Contents", [])}


def body(s3: S3Server, bucket: str, key: str) -> bytes:
    return bytes(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def request(src: Path, out: str, s3: S3Server, fmt: str, tp: int = 2) -> StageRequest:
    return StageRequest(source=str(src), out=out, tp=tp, format=fmt,
                        s3=s3.options(part_bytes=5 * MiB, concurrency=4))  # fmt: skip


def cli_stage(src: Path, out: str, s3: S3Server, fmt: str, env: dict[str, str],
              *extra: str) -> subprocess.Popen[str]:  # fmt: skip
    cmd = [str(Path(sys.executable).with_name("modelstage")), "stage", str(src), "--tp", "2",
           "--format", fmt, "--out", out, "--s3-endpoint", s3.endpoint, "--s3-path-style",
           *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd="/")  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, **extra}


def test_rank_files_on_s3_equal_the_local_sharded_state_byte_for_byte(
    s3: S3Server, bucket: str, multipart_ckpt: Path, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    stage(StageRequest(source=str(multipart_ckpt), out=str(local), tp=2))
    summary = stage(request(multipart_ckpt, f"s3://{bucket}/art/", s3, "runai_streamer_sharded"))
    assert summary["uri"] == f"s3://{bucket}/art/" and not summary["alreadyStaged"]

    found = objects(s3, bucket, "art/")
    manifest = json.loads(body(s3, bucket, "art/" + MANIFEST))
    assert manifest["format"] == "runai_streamer_sharded" and manifest["tensorParallelSize"] == 2
    assert set(found) == {p.name for p in local.iterdir()}
    local_manifest = json.loads((local / MANIFEST).read_text())
    assert manifest["files"] == local_manifest["files"]  # same sizes and hashes, file by file
    multipart = 0
    for name, entry in manifest["files"].items():
        data = body(s3, bucket, "art/" + name)
        assert data == (local / name).read_bytes(), name
        head = s3.client().head_object(Bucket=bucket, Key="art/" + name)
        digest = digest_bytes(data, entry["chunkBytes"])
        assert list(digest.chunks) == entry["chunks"]
        assert head["Metadata"]["blake3"] == entry["blake3"] == digest.root
        assert head["Metadata"]["blake3-chunk-bytes"] == str(entry["chunkBytes"])
        multipart += "-" in head["ETag"]
    assert multipart == 2, "each rank file (~20 MB) must have gone up as a multipart upload"


def test_gpt_oss_rank_files_on_s3_equal_the_local_sharded_state_byte_for_byte(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Transposed expert slices and the rank-0-only bias take the same path to S3."""
    spec = SyntheticModel(architecture="GptOssForCausalLM", dtype="bfloat16", num_shards=2,
                          num_kv_heads=2, seed=14)  # fmt: skip
    src = write_checkpoint(spec, tmp_path / "src")
    local = tmp_path / "local"
    stage(StageRequest(source=str(src), out=str(local), tp=2))
    stage(request(src, f"s3://{bucket}/oss/", s3, "runai_streamer_sharded"))
    manifest = json.loads(body(s3, bucket, "oss/" + MANIFEST))
    assert manifest["files"] == json.loads((local / MANIFEST).read_text())["files"]
    for name in manifest["files"]:
        assert body(s3, bucket, "oss/" + name) == (local / name).read_bytes(), name


def test_runai_streamer_copies_the_hugging_face_layout_byte_for_byte(
    s3: S3Server, bucket: str, multipart_ckpt: Path
) -> None:
    stage(request(multipart_ckpt, f"s3://{bucket}/hf", s3, "runai_streamer"))
    found = objects(s3, bucket, "hf/")
    source_files = {p.name for p in multipart_ckpt.iterdir()}
    assert set(found) - {MANIFEST} == source_files  # weights, index, config, tokenizer, ...
    for name in source_files:
        assert body(s3, bucket, "hf/" + name) == (multipart_ckpt / name).read_bytes(), name
    manifest = json.loads(body(s3, bucket, "hf/" + MANIFEST))
    assert manifest["format"] == "runai_streamer" and set(manifest["files"]) == source_files


def test_manifest_is_the_last_object_written(
    s3: S3Server, bucket: str, multipart_ckpt: Path
) -> None:
    stage(request(multipart_ckpt, f"s3://{bucket}/a", s3, "runai_streamer_sharded"))
    found = objects(s3, bucket, "a/")
    committed = found.pop(MANIFEST)["LastModified"]
    assert all(o["LastModified"] <= committed for o in found.values())


def test_rerun_reuses_complete_objects_and_rewrites_the_missing_one(
    s3: S3Server, bucket: str, multipart_ckpt: Path
) -> None:
    """The state a crash between two objects leaves: some objects complete, no manifest."""
    out = f"s3://{bucket}/resume/"
    stage(request(multipart_ckpt, out, s3, "runai_streamer_sharded"))
    before = objects(s3, bucket, "resume/")
    original = body(s3, bucket, "resume/model-rank-1-part-0.safetensors")
    s3.client().delete_object(Bucket=bucket, Key="resume/" + MANIFEST)
    s3.client().delete_object(Bucket=bucket, Key="resume/model-rank-1-part-0.safetensors")
    assert S3Destination(out, s3.options()).existing() is None

    time.sleep(1.1)  # LastModified has one-second resolution
    summary = stage(request(multipart_ckpt, out, s3, "runai_streamer_sharded"))
    assert not summary["alreadyStaged"]
    after = objects(s3, bucket, "resume/")
    rewritten = {n for n in before if after[n]["LastModified"] != before[n]["LastModified"]}
    assert rewritten == {"model-rank-1-part-0.safetensors", MANIFEST}
    assert body(s3, bucket, "resume/model-rank-1-part-0.safetensors") == original
    verify(open_artifact(out, s3.options()), hash_content=True)


def test_a_rerun_for_another_source_identity_rewrites_every_object(
    s3: S3Server, bucket: str, make_small_ckpt: Path
) -> None:
    out = f"s3://{bucket}/moved/"
    stage(request(make_small_ckpt, out, s3, "runai_streamer"))
    s3.client().delete_object(Bucket=bucket, Key="moved/" + MANIFEST)
    before = objects(s3, bucket, "moved/")
    # the source changed between the runs (a moved branch): its identity, and so the run
    # key, differs; streamed objects are rewritten, small files only where their bytes differ
    (make_small_ckpt / "generation_config.json").write_text('{"eos_token_id": 2}')
    time.sleep(1.1)
    stage(request(make_small_ckpt, out, s3, "runai_streamer"))
    after = objects(s3, bucket, "moved/")
    rewritten = {n for n in before if after[n]["LastModified"] != before[n]["LastModified"]}
    assert rewritten == {"model.safetensors", "generation_config.json"}
    assert body(s3, bucket, "moved/generation_config.json") == b'{"eos_token_id": 2}'
    verify(open_artifact(out, s3.options()), hash_content=True)


def test_killed_upload_leaves_nothing_complete_and_a_rerun_finishes_it(
    s3: S3Server, bucket: str, big_ckpt: Path
) -> None:
    out = f"s3://{bucket}/killed/"
    env = clean_env(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key)
    proc = cli_stage(big_ckpt, out, s3, "runai_streamer_sharded", env)
    client, deadline = s3.client(), time.monotonic() + 120
    try:
        while not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
            assert proc.poll() is None, "the stager finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert MANIFEST not in objects(s3, bucket, "killed/")
    assert S3Destination(out, s3.options()).existing() is None
    assert cli.main(["verify", out, "--s3-endpoint", s3.endpoint, "--s3-path-style",
                     "--s3-credentials-file", str(s3.credentials_file)]) == 1  # fmt: skip

    rerun = cli_stage(big_ckpt, out, s3, "runai_streamer_sharded", env)
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    assert json.loads(stdout.splitlines()[-1])["alreadyStaged"] is False
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    verify(open_artifact(out, s3.options()), hash_content=True)


def test_complete_artifact_is_not_staged_again(
    s3: S3Server, bucket: str, make_small_ckpt: Path
) -> None:
    req = request(make_small_ckpt, f"s3://{bucket}/once", s3, "runai_streamer_sharded")
    first = stage(req)
    again = stage(req)
    assert again["alreadyStaged"] and again["digest"] == first["digest"]


def test_objects_not_written_by_modelstage_are_never_overwritten(
    s3: S3Server, bucket: str, make_small_ckpt: Path
) -> None:
    s3.client().put_object(Bucket=bucket, Key="theirs/config.json", Body=b"{}")
    with pytest.raises(ArtifactError, match="not written by modelstage"):
        stage(request(make_small_ckpt, f"s3://{bucket}/theirs/", s3, "runai_streamer"))
    assert body(s3, bucket, "theirs/config.json") == b"{}"


def test_sharded_state_to_s3_is_refused_with_the_format_to_use(
    s3: S3Server, make_small_ckpt: Path
) -> None:
    with pytest.raises(SpecError, match="runai_streamer_sharded"):
        stage(request(make_small_ckpt, "s3://any-bucket/x", s3, "sharded_state"))


def test_verify_s3_detects_a_corrupt_object_only_when_hashing(
    s3: S3Server, bucket: str, make_small_ckpt: Path
) -> None:
    out = f"s3://{bucket}/v/"
    stage(request(make_small_ckpt, out, s3, "runai_streamer_sharded"))
    key = "v/model-rank-0-part-0.safetensors"
    data = bytearray(body(s3, bucket, key))
    data[-1] ^= 0xFF
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    args = ["verify", out, "--s3-endpoint", s3.endpoint, "--s3-path-style",
            "--s3-credentials-file", str(s3.credentials_file)]  # fmt: skip
    assert cli.main([*args, "--sizes-only"]) == 0
    assert cli.main(args) == 1


def test_credentials_never_appear_in_outputs_manifest_or_errors(
    s3: S3Server, bucket: str, make_small_ckpt: Path, tmp_path: Path
) -> None:
    secret_dir = tmp_path / "secret"  # a Secret mounted as one file per key
    secret_dir.mkdir()
    (secret_dir / "aws_access_key_id").write_text(s3.access_key + "\n")
    (secret_dir / "aws_secret_access_key").write_text(s3.secret_key + "\n")
    term_log = tmp_path / "termination-log"
    term_log.touch()
    outputs: list[str] = []

    ok = cli_stage(
        make_small_ckpt,
        f"s3://{bucket}/c/",
        s3,
        "runai_streamer",
        clean_env(MODELSTAGE_TERMINATION_LOG=str(term_log)),
        "--s3-credentials-file",
        str(secret_dir),
    )
    outputs += ok.communicate(timeout=120)
    assert ok.returncode == 0, outputs[-1]
    outputs.append(term_log.read_text())

    wrong_secret = "ms-wrong-secret/Narwhal+Pangolin+9931"
    bad = cli_stage(make_small_ckpt, f"s3://{bucket}/d/", s3, "runai_streamer", clean_env(
        AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=wrong_secret,
        MODELSTAGE_TERMINATION_LOG=str(term_log)))  # fmt: skip
    outputs += bad.communicate(timeout=120)
    assert bad.returncode == 1
    last = outputs[-1].strip().splitlines()[-1]
    assert "SignatureDoesNotMatch" in last and "credentials" not in last.split(";")[0]
    outputs.append(term_log.read_text())

    outputs.append(body(s3, bucket, "c/" + MANIFEST).decode())
    for text in outputs:
        for secret in (s3.access_key, s3.secret_key, wrong_secret):
            assert secret not in text


def test_credentials_file_errors_do_not_quote_the_file(tmp_path: Path) -> None:
    from modelstage.core.s3_client import load_credentials

    secret = "ms-secret-in-a-broken-file/Walrus+77"
    broken = tmp_path / "credentials"
    broken.write_text(f"aws_secret_access_key = {secret}\n")  # no section header
    with pytest.raises(SpecError) as e:
        load_credentials(str(broken))
    assert secret not in str(e.value)


def test_many_objects_open_at_once_get_smaller_parts_down_to_s3s_minimum() -> None:
    """Each open object holds a part buffer: memory stays bounded at high TP."""
    from modelstage.core.s3_client import S3Options
    from modelstage.stager.destinations.s3 import MIN_PART_BYTES, S3Destination

    options = S3Options(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    assert S3Destination("s3://b/p", options, open_files=8).part_bytes == options.part_bytes
    assert S3Destination("s3://b/p", options, open_files=16).part_bytes > MIN_PART_BYTES
    assert S3Destination("s3://b/p", options, open_files=16).part_bytes < options.part_bytes
    assert S3Destination("s3://b/p", options, open_files=100).part_bytes == MIN_PART_BYTES


def test_phi3_rank_objects_cut_from_fused_sources_equal_the_local_sharded_state(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Phi-3's fused ``qkv_proj``/``gate_up_proj`` need nothing of the S3 writer: the rank
    objects equal the local rank files (proven against vLLM by tests/vllm) byte for byte."""
    from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint

    spec = SyntheticModel(architecture="Phi3ForCausalLM", num_kv_heads=2, num_shards=2, seed=13)
    src = write_checkpoint(spec, tmp_path / "phi3")
    local = tmp_path / "local"
    stage(StageRequest(source=str(src), out=str(local), tp=4))
    stage(request(src, f"s3://{bucket}/phi3/", s3, "runai_streamer_sharded", tp=4))
    found = objects(s3, bucket, "phi3/")
    ranks = sorted(n for n in found if n.startswith("model-rank-"))
    assert len(ranks) == 4 and set(found) == {p.name for p in local.iterdir()}
    for name in ranks:
        assert body(s3, bucket, "phi3/" + name) == (local / name).read_bytes(), name
