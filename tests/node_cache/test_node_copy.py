"""``modelstage node-copy``: a verified, atomic, resumable copy into the node root, from a
local artifact or S3; a corrupt source is refused with the file and chunk named and nothing
renamed; a stopped copy resumes without rewriting the files it verified; nothing is ever
written outside the root."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from modelstage.core import node_cache
from modelstage.core.location import verify_directory
from modelstage.core.manifest import MANIFEST, Manifest
from modelstage.stager.cli import main
from modelstage.stager.stage import StageRequest, stage
from support.killer import kill_after_writing
from support.node_agent import CHUNK, digest_of
from support.s3_server import ACCESS_KEY, SECRET_KEY, S3Server

HEX = "[0-9a-f]{64}"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any] | str]:
    code = main(["node-copy", *argv])
    out, err = capsys.readouterr()
    if code == 0:
        return code, json.loads(out.strip().splitlines()[-1])
    return code, err.strip()


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_copies_a_local_artifact_verified_and_atomic(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, digest = tmp_path / "root", digest_of(artifact)
    code, summary = run_cli(capsys, "--artifact", str(artifact), "--digest", digest, "--tp", "2",
                            "--root", str(root))  # fmt: skip
    assert code == 0, summary
    assert isinstance(summary, dict)
    manifest = Manifest.from_json((artifact / MANIFEST).read_bytes(), "source")
    assert summary["digest"] == digest and summary["root"] == str(root)
    assert summary["bytes"] == manifest.bytes and summary["files"] == len(manifest.files)
    assert summary["resumedFiles"] == 0 and summary["alreadyComplete"] is False
    assert summary["bytesPerSecond"] > 0
    copy = node_cache.copy_dir(root, digest)
    assert tree(copy) == tree(artifact)  # every file, and the manifest byte for byte
    verify_directory(copy, digest=digest, tp=2)
    assert list((root / node_cache.PARTIAL).iterdir()) == [node_cache.lock_file(root, digest)]
    record = json.loads(node_cache.state_file(root, digest).read_text())
    assert record["digest"] == digest and record["bytes"] == manifest.bytes
    assert record["files"] == len(manifest.files) and record["source"] == str(artifact)
    assert record["copySeconds"] >= 0 and record["copiedAt"] and record["lastUsed"]


def test_a_complete_copy_makes_it_a_no_op(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, digest = tmp_path / "root", digest_of(artifact)
    args = ("--artifact", str(artifact), "--digest", digest, "--root", str(root))
    assert run_cli(capsys, *args)[0] == 0
    copy = node_cache.copy_dir(root, digest)
    before = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    code, summary = run_cli(capsys, *args)
    assert code == 0 and isinstance(summary, dict)
    assert summary["alreadyComplete"] is True and summary["resumedFiles"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == before


def flip_middle_chunk(directory: Path) -> tuple[str, int]:
    """Flips one byte in a middle chunk of the first rank-1 file (same size); its name and
    the chunk."""
    name = sorted(p.name for p in directory.glob("model-rank-1-part-*.safetensors"))[0]
    path = directory / name
    data = bytearray(path.read_bytes())
    chunks = -(-len(data) // CHUNK)
    assert chunks >= 3, "the test needs a file of several chunks"
    index = chunks // 2
    data[index * CHUNK + 1234] ^= 0x40
    path.write_bytes(bytes(data))
    return name, index


def test_a_corrupt_source_is_refused_naming_file_and_chunk_and_nothing_is_renamed(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "source"
    shutil.copytree(artifact, source)
    name, index = flip_middle_chunk(source)
    root, digest = tmp_path / "root", digest_of(artifact)
    code, err = run_cli(capsys, "--artifact", str(source), "--digest", digest, "--root", str(root))
    assert code == 1
    begin, end = index * CHUNK, (index + 1) * CHUNK - 1
    assert re.fullmatch(
        rf"error: {re.escape(str(source / name))}: chunk {index} \(bytes {begin}-{end}\): "
        rf"expected {HEX}, got {HEX}", str(err)
    ), err  # fmt: skip
    assert not node_cache.copy_dir(root, digest).exists()
    partial = node_cache.partial_dir(root, digest)
    assert not (partial / MANIFEST).exists() and not (partial / name).exists()
    for kept in partial.iterdir():  # only what verified stays, byte for byte the source's
        assert kept.read_bytes() == (artifact / kept.name).read_bytes()


def test_a_copy_killed_in_the_middle_resumes_without_rewriting_verified_files(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    digest = digest_of(artifact)
    total = sum(p.stat().st_size for p in artifact.iterdir())
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    for attempt in range(5):
        root = tmp_path / f"root{attempt}"
        cmd = [sys.executable, "-m", "modelstage.stager.cli", "node-copy", "--artifact",
               str(artifact), "--digest", digest, "--root", str(root)]  # fmt: skip
        kill = kill_after_writing(cmd, total * 6 // 10, env=env, log=tmp_path / f"log{attempt}")
        if kill.written >= 0:
            break
    else:
        pytest.fail("the copy finished before every kill point")
    assert kill.returncode == -9
    assert not node_cache.copy_dir(root, digest).exists()
    partial = node_cache.partial_dir(root, digest)
    manifest = Manifest.from_json((artifact / MANIFEST).read_bytes(), "source")
    whole = {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in partial.iterdir()
        if p.name in manifest.files and p.stat().st_size == manifest.files[p.name].size
    }
    assert whole, "the kill left no whole file to resume"
    assert len(whole) < len(manifest.files)
    code, summary = run_cli(capsys, "--artifact", str(artifact), "--digest", digest,
                            "--root", str(root))  # fmt: skip
    assert code == 0 and isinstance(summary, dict)
    assert summary["resumedFiles"] == len(whole)
    copy = node_cache.copy_dir(root, digest)
    assert {n: (copy / n).stat().st_ino for n in whole} == {n: v[0] for n, v in whole.items()}
    assert {n: (copy / n).stat().st_mtime_ns for n in whole} == {n: v[1] for n, v in whole.items()}
    assert tree(copy) == tree(artifact)
    assert not partial.exists()


def test_a_resumed_file_that_does_not_verify_is_rewritten(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file of the right size left by a crash whose bytes never reached the disk."""
    root, digest = tmp_path / "root", digest_of(artifact)
    partial = node_cache.partial_dir(root, digest)
    partial.mkdir(parents=True)
    name = sorted(p.name for p in artifact.glob("model-rank-0-part-*.safetensors"))[0]
    (partial / name).write_bytes(b"\0" * (artifact / name).stat().st_size)
    (partial / "stray.tmp").write_bytes(b"x")
    code, summary = run_cli(capsys, "--artifact", str(artifact), "--digest", digest,
                            "--root", str(root))  # fmt: skip
    assert code == 0 and isinstance(summary, dict) and summary["resumedFiles"] == 0
    assert tree(node_cache.copy_dir(root, digest)) == tree(artifact)


def test_copies_from_s3(
    s3: S3Server, bucket: str, checkpoint: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    uri = f"s3://{bucket}/artifacts/x/"
    stage(StageRequest(source=str(checkpoint), out=uri, tp=2, format="runai_streamer_sharded",
                       s3=s3.options(), chunk_bytes=CHUNK))  # fmt: skip
    local = tmp_path / "local"
    local.mkdir()
    client = s3.client()
    for obj in client.list_objects_v2(Bucket=bucket, Prefix="artifacts/x/")["Contents"]:
        body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        (local / obj["Key"].rsplit("/", 1)[1]).write_bytes(body)
    digest, root = digest_of(local), tmp_path / "root"
    env = {**os.environ, **s3.env(), "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "modelstage.stager.cli", "node-copy", "--artifact", uri,
         "--digest", digest, "--tp", "2", "--root", str(root), "--s3-path-style"],
        env=env, capture_output=True, text=True, timeout=300, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["digest"] == digest and summary["files"] == len(list(local.iterdir())) - 1
    copy = node_cache.copy_dir(root, digest)
    assert tree(copy) == tree(local)
    verify_directory(copy, digest=digest, tp=2)
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert secret not in done.stdout + done.stderr
        assert secret not in node_cache.state_file(root, digest).read_text()


def test_refuses_the_wrong_tensor_parallel_size(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    code, err = run_cli(capsys, "--artifact", str(artifact), "--digest", digest_of(artifact),
                        "--tp", "4", "--root", str(root))  # fmt: skip
    assert code == 1 and "staged for tensor parallel size 2" in str(err)
    assert not root.exists()


@pytest.mark.parametrize("digest", ["../x", "..", "A" * 64, "ab/cd", "0" * 63])
def test_a_bad_digest_writes_nothing(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], digest: str
) -> None:
    root = tmp_path / "sub" / "root"
    code, err = run_cli(capsys, "--artifact", str(artifact), "--digest", digest, "--root", str(root))
    assert code == 1 and "is not an artifact digest" in str(err)
    assert not (tmp_path / "sub").exists()


def test_a_manifest_naming_a_path_outside_writes_nothing(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "src" / "artifact"
    shutil.copytree(artifact, source)
    doc = json.loads((source / MANIFEST).read_text())
    name = sorted(doc["files"])[0]
    doc["files"]["../x"] = doc["files"].pop(name)
    (source / MANIFEST).write_text(json.dumps(doc))
    (source.parent / "x").write_bytes((artifact / name).read_bytes())
    root = tmp_path / "root"
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    code, err = run_cli(capsys, "--artifact", str(source), "--digest", doc["digest"],
                        "--root", str(root))  # fmt: skip
    assert code == 1 and "invalid manifest" in str(err) and "'../x'" in str(err)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("where", ["copy", "partial", "partial-root", "state"])
def test_a_link_in_the_root_is_replaced_not_followed(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """A link where the copy goes (``<digest>``, ``.partial/<digest>``, ``.partial``,
    ``.state``) pointing out of the root: the link itself is replaced, and what it pointed
    at is left as it was."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"precious")
    (outside / MANIFEST).write_bytes(b"not ours")
    root, digest = tmp_path / "root", digest_of(artifact)
    link = {
        "copy": node_cache.copy_dir(root, digest),
        "partial": node_cache.partial_dir(root, digest),
        "partial-root": root / node_cache.PARTIAL,
        "state": root / node_cache.STATE,
    }[where]
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, link)
    code, summary = run_cli(capsys, "--artifact", str(artifact), "--digest", digest,
                            "--root", str(root))  # fmt: skip
    assert code == 0, summary
    assert tree(outside) == {"keep": b"precious", MANIFEST: b"not ours"}
    assert not link.is_symlink()
    assert tree(node_cache.copy_dir(root, digest)) == tree(artifact)
