"""Staging to and from Azure Blob against a real endpoint (Azurite on 127.0.0.1): byte-exact
round trips, per-blob content-hash metadata, the manifest as the commit point, reruns that
upload nothing already complete, and ``verify`` of an ``az://`` artifact."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.errors import ArtifactError, SpecError
from modelstage.core.integrity import digest_bytes
from modelstage.core.location import open_artifact, verify
from modelstage.core.manifest import MANIFEST
from modelstage.stager.stage import StageRequest, stage
from support.azurite import KEY, Azurite

MiB = 1024 * 1024


def blobs(az: Azurite, container: str, prefix: str) -> dict[str, Any]:
    """{name under prefix: BlobProperties} with a plain SDK client."""
    listed = az.container(container).list_blobs(name_starts_with=prefix, include=["metadata"])
    return {b.name[len(prefix) :]: b for b in listed}


def body(az: Azurite, container: str, name: str) -> bytes:
    return bytes(az.container(container).download_blob(name).readall())


def request(src: Path | str, out: str, az: Azurite, fmt: str, tp: int = 2) -> StageRequest:
    return StageRequest(source=str(src), out=out, tp=tp, format=fmt,
                        azure=az.options(block_bytes=1 * MiB, concurrency=4))  # fmt: skip


def uploads(az: Azurite) -> dict[str, int]:
    return {op: az.requests(op) for op in ("StageBlock", "Upload", "CommitBlockList")}


def test_tp2_rank_files_on_azure_equal_the_local_sharded_state_and_verify(
    az: Azurite, container: str, multiblock_ckpt: Path, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    stage(StageRequest(source=str(multiblock_ckpt), out=str(local), tp=2))
    out = f"az://{container}/art/"
    summary = stage(request(multiblock_ckpt, out, az, "runai_streamer_sharded"))
    assert summary["uri"] == out and not summary["alreadyStaged"]

    found = blobs(az, container, "art/")
    manifest = json.loads(body(az, container, "art/" + MANIFEST))
    assert manifest["format"] == "runai_streamer_sharded" and manifest["tensorParallelSize"] == 2
    assert set(found) == {p.name for p in local.iterdir()}
    assert manifest["files"] == json.loads((local / MANIFEST).read_text())["files"]
    in_blocks = 0
    for name, entry in manifest["files"].items():
        data = body(az, container, "art/" + name)
        assert data == (local / name).read_bytes(), name
        meta = found[name].metadata
        assert meta["blake3"] == entry["blake3"] == digest_bytes(data, entry["chunkBytes"]).root
        assert meta["blake3_chunk_bytes"] == str(entry["chunkBytes"])
        committed, _ = az.container(container).get_blob_client("art/" + name).get_block_list()
        in_blocks += len(committed) > 1
    assert in_blocks == 2, "each rank file (~15 MB) must have gone up in 1 MiB blocks"
    assert found[MANIFEST].last_modified >= max(b.last_modified for b in found.values())
    checked = verify(open_artifact(out, azure=az.options()))
    assert checked.digest == summary["digest"]


def test_a_rerun_uploads_nothing_already_complete(
    az: Azurite, container: str, multiblock_ckpt: Path
) -> None:
    out = f"az://{container}/again/"
    first = stage(request(multiblock_ckpt, out, az, "runai_streamer_sharded"))
    before = uploads(az)
    again = stage(request(multiblock_ckpt, out, az, "runai_streamer_sharded"))
    assert again["alreadyStaged"] and again["digest"] == first["digest"]
    assert uploads(az) == before, "a complete artifact is not uploaded again"

    # A run killed just before its commit: every blob complete, no manifest. The rerun reads
    # them back, checks their hashes and writes the manifest alone.
    stamps = {n: b.last_modified for n, b in blobs(az, container, "again/").items()}
    az.container(container).delete_blob("again/" + MANIFEST)
    resumed = stage(request(multiblock_ckpt, out, az, "runai_streamer_sharded"))
    after = uploads(az)
    assert resumed["digest"] == first["digest"] and not resumed["alreadyStaged"]
    assert after["StageBlock"] == before["StageBlock"]
    assert after["CommitBlockList"] == before["CommitBlockList"]
    assert after["Upload"] == before["Upload"] + 1, "only the manifest is written again"
    now = blobs(az, container, "again/")
    assert all(now[n].last_modified == t for n, t in stamps.items() if n != MANIFEST)
    verify(open_artifact(out, azure=az.options()))


def test_a_blob_whose_bytes_differ_is_uploaded_again_not_reused(
    az: Azurite, container: str, multiblock_ckpt: Path
) -> None:
    out = f"az://{container}/fix/"
    stage(request(multiblock_ckpt, out, az, "runai_streamer_sharded"))
    cc = az.container(container)
    cc.delete_blob("fix/" + MANIFEST)
    name = "fix/model-rank-1-part-0.safetensors"
    props = cc.get_blob_client(name).get_blob_properties()
    data = bytearray(body(az, container, name))
    data[-1] ^= 0xFF  # same size, same metadata: only reading it back can tell
    cc.upload_blob(name, bytes(data), overwrite=True, metadata=props.metadata)
    before = uploads(az)
    stage(request(multiblock_ckpt, out, az, "runai_streamer_sharded"))
    assert uploads(az)["CommitBlockList"] == before["CommitBlockList"] + 1
    verify(open_artifact(out, azure=az.options()))


def test_staging_from_azure_equals_staging_from_the_local_copy(
    az: Azurite, container: str, multiblock_ckpt: Path, tmp_path: Path
) -> None:
    cc = az.container(container)
    for f in multiblock_ckpt.iterdir():
        cc.upload_blob(f"ckpt/{f.name}", f.read_bytes(), overwrite=True)
    from_local, from_az = tmp_path / "from-local", tmp_path / "from-az"
    stage(StageRequest(source=str(multiblock_ckpt), out=str(from_local), tp=2))
    summary = stage(request(f"az://{container}/ckpt", str(from_az), az, "sharded_state"))
    local_files = {p.name for p in from_local.iterdir()} - {MANIFEST}
    assert {p.name for p in from_az.iterdir()} - {MANIFEST} == local_files
    for name in local_files:
        assert (from_az / name).read_bytes() == (from_local / name).read_bytes(), name
    manifest = json.loads((from_az / MANIFEST).read_text())
    source = manifest["source"]
    assert source["kind"] == "az" and summary["source"] == source["uri"]
    assert source["uri"] == f"az://{container}/ckpt"
    etags = {f["name"]: f["etag"] for f in source["files"]}
    listed = blobs(az, container, "ckpt/")
    assert etags == {n: listed[n].etag.strip('"') for n in etags}


def test_verify_refuses_an_altered_or_truncated_blob(
    az: Azurite, container: str, multiblock_ckpt: Path
) -> None:
    out = f"az://{container}/bad/"
    stage(request(multiblock_ckpt, out, az, "runai_streamer_sharded"))
    cc = az.container(container)
    name = "bad/model-rank-0-part-0.safetensors"
    data = bytearray(body(az, container, name))
    data[len(data) // 2] ^= 0x01
    cc.upload_blob(name, bytes(data), overwrite=True)
    with pytest.raises(ArtifactError, match=f"az://{container}/{name}"):
        verify(open_artifact(out, azure=az.options()))
    cc.upload_blob(name, bytes(data[:-10]), overwrite=True)
    with pytest.raises(ArtifactError, match=r"model-rank-0-part-0\.safetensors"):
        verify(open_artifact(out, azure=az.options()), hash_content=False)


def test_formats_vllm_cannot_read_from_azure_are_refused_before_anything_is_written(
    az: Azurite, container: str, multiblock_ckpt: Path
) -> None:
    with pytest.raises(SpecError, match="stage to Azure Blob with --format"):
        stage(request(multiblock_ckpt, f"az://{container}/no/", az, "sharded_state"))
    assert blobs(az, container, "no/") == {}


def modelstage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [str(Path(sys.executable).with_name("modelstage")), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd="/")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZURE_")}
    return {**env, **extra}


def test_the_cli_stages_and_verifies_az_and_never_prints_the_key(
    az: Azurite, container: str, multiblock_ckpt: Path
) -> None:
    out = f"az://{container}/cli/"
    env = clean_env(**az.env())
    staged = modelstage("stage", str(multiblock_ckpt), "--tp", "2", "--format",
                        "runai_streamer_sharded", "--out", out, env=env)  # fmt: skip
    assert staged.returncode == 0, staged.stderr
    checked = modelstage("verify", out, env=env)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout.strip().splitlines()[-1])["verified"] == out
    # the same account through AZURE_STORAGE_ACCOUNT / _KEY / _BLOB_ENDPOINT
    by_key = clean_env(AZURE_STORAGE_ACCOUNT="msteststore", AZURE_STORAGE_KEY=KEY,
                       AZURE_STORAGE_BLOB_ENDPOINT=az.endpoint)  # fmt: skip
    assert modelstage("verify", out, env=by_key).returncode == 0
    wrong = clean_env(AZURE_STORAGE_ACCOUNT="msteststore", AZURE_STORAGE_BLOB_ENDPOINT=az.endpoint,
                      AZURE_STORAGE_KEY=KEY[::-1])  # fmt: skip
    refused = modelstage("verify", out, env=wrong)
    assert refused.returncode != 0
    assert "AuthenticationFailed" in refused.stderr or "403" in refused.stderr, refused.stderr
    for run in (staged, checked, refused):
        assert KEY not in run.stdout + run.stderr and KEY[::-1] not in run.stdout + run.stderr
        assert "Traceback" not in run.stderr


def test_delete_removes_an_az_artifact_manifest_first_and_force_restages(
    az: Azurite, container: str, multiblock_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelstage.stager.delete import delete_artifact

    for name, value in az.env().items():
        monkeypatch.setenv(name, value)
    out = f"az://{container}/gone/"
    first = stage(request(multiblock_ckpt, out, az, "runai_streamer_sharded"))
    forced = stage(dataclasses.replace(request(multiblock_ckpt, out, az, "runai_streamer_sharded"),
                                       force=True))  # fmt: skip
    assert not forced["alreadyStaged"] and forced["digest"] == first["digest"]
    present = len(blobs(az, container, "gone/"))
    done = delete_artifact(out)
    assert (done["digest"], done["removed"]) == (first["digest"], present)
    assert blobs(az, container, "gone/") == {}
    assert delete_artifact(out, digest=first["digest"])["removed"] == 0  # idempotent
