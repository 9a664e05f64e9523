"""Content verification of S3 artifacts against a real S3 server (SeaweedFS on 127.0.0.1): the
plugin's S3 reader checks each hash chunk as its ranged GET lands, ``verify`` reads every
object in parallel chunks, and a rerun re-hashes an object before reusing it. Every refusal
names the object, the chunk and both hashes."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
import torch
from modelstage.core.errors import ArtifactError
from modelstage.core.integrity import ChunkMismatch, digest_bytes
from modelstage.core.location import open_artifact
from modelstage.core.location import verify as verify_artifact
from modelstage.core.manifest import MANIFEST, Manifest
from modelstage.core.s3_client import S3Client
from modelstage.plugin.checks import (
    VerifiedArtifact,
    content_checker,
    verify_content,
    verify_s3,
)
from modelstage.plugin.reader import TORCH_DTYPES, PipelinedReader, Target, flat_bytes
from modelstage.plugin.settings import PluginSettings, serving_s3_options
from modelstage.plugin.stores import store_for
from modelstage.stager.stage import StageRequest, stage
from safetensors.torch import load_file
from support.s3_server import S3Server

MiB = 1024 * 1024
CHUNK = MiB
BUCKET = "verify"
RANK1 = "model-rank-1-part-*.safetensors"
HEX = "[0-9a-f]{64}"


@pytest.fixture(scope="module")
def local(multipart_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "local"
    stage(StageRequest(source=str(multipart_ckpt), out=str(out), tp=2))
    return out


@pytest.fixture
def staged(s3: S3Server, multipart_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh TP=2 ``runai_streamer_sharded`` artifact in 1 MiB hash chunks (about twenty
    per rank object)."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    if BUCKET not in {b["Name"] for b in s3.client().list_buckets()["Buckets"]}:
        s3.create_bucket(BUCKET)
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/"
    stage(StageRequest(source=str(multipart_ckpt), out=uri, tp=2, format="runai_streamer_sharded",
                       s3=s3.options(), chunk_bytes=CHUNK))  # fmt: skip
    return uri


def key(uri: str, name: str) -> str:
    return uri.removeprefix(f"s3://{BUCKET}/") + name


def corrupt(s3: S3Server, uri: str, name: str, offset: int) -> bytes:
    """Flip one byte of an object in place, keeping its size and its metadata (run key and
    recorded hash): only reading the bytes tells. Returns the new content."""
    raw = s3.client()
    got = raw.get_object(Bucket=BUCKET, Key=key(uri, name))
    data = bytearray(got["Body"].read())
    data[offset] ^= 0x20
    raw.put_object(Bucket=BUCKET, Key=key(uri, name), Body=bytes(data), Metadata=got["Metadata"])
    return bytes(data)


def verify(uri: str) -> VerifiedArtifact:
    return verify_s3(uri, S3Client(serving_s3_options()), load_format="runai_streamer_sharded",
                     settings=PluginSettings(tp=2), running_tp=2, vllm_version="0.32.0",
                     rank_glob=RANK1)  # fmt: skip


def read(verified: VerifiedArtifact, *, depth: int, direct: bool) -> dict[str, torch.Tensor]:
    checker = content_checker(verified)
    assert checker is not None
    tensors = {n: torch.full(i.shape, float("nan"), dtype=TORCH_DTYPES[i.dtype])
               for f in verified.files for n, i in f.header.tensors.items()}  # fmt: skip
    reader = PipelinedReader(chunk_bytes=checker.read_bytes(2 * MiB), depth=depth,
                             device=torch.device("cpu"), direct=direct)  # fmt: skip
    stats = reader.read(store_for(verified), lambda i: Target(flat_bytes(tensors[i.name])), checker)
    assert checker.stats.bytes == stats.bytes == verified.bytes, "every byte read and hashed"
    return tensors


@pytest.mark.parametrize(("depth", "direct"), [(8, True), (3, False)])
def test_the_s3_reader_verifies_every_byte_and_fills_every_tensor(
    staged: str, local: Path, depth: int, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import modelstage.plugin.stores as stores

    verified = verify(staged)
    gets: list[int] = []
    real = stores.get_range_into

    def counted(
        client: object, bucket: str, key: str, etag: str, offset: int, views: object
    ) -> None:
        gets.append(offset)
        real(client, bucket, key, etag, offset, views)  # type: ignore[arg-type]

    monkeypatch.setattr(stores, "get_range_into", counted)
    got = read(verified, depth=depth, direct=direct)
    assert all(offset >= CHUNK for offset in gets), "the header's chunk is not fetched again"
    assert sorted(gets) == sorted(set(gets)) and len(gets) >= 10
    for path in sorted(local.glob(RANK1)):
        for name, tensor in load_file(path).items():
            assert torch.equal(got[name], tensor), name


def mismatch(uri: str, name: str, data: bytes, offset: int) -> str:
    """The refusal's expected text for a flipped byte at ``offset`` of object ``name``."""
    index = offset // CHUNK
    lo, hi = index * CHUNK, min((index + 1) * CHUNK, len(data))
    actual = digest_bytes(data[lo:hi], CHUNK).chunks[0]
    return (
        f"{uri}{name}: chunk {index} (bytes {lo}-{hi - 1}) has BLAKE3 {actual}, the manifest says "
    )


@pytest.mark.parametrize("where", ["middle", "last"])
@pytest.mark.parametrize("direct", [True, False])
def test_a_corrupt_object_fails_the_s3_reader_naming_object_and_chunk(
    s3: S3Server, staged: str, where: str, direct: bool
) -> None:
    name = "model-rank-1-part-0.safetensors"
    size = s3.client().head_object(Bucket=BUCKET, Key=key(staged, name))["ContentLength"]
    offset = size // 2 if where == "middle" else size - 1
    data = corrupt(s3, staged, name, offset)
    verified = verify(staged)  # the header's chunk is intact: the damage is met while reading
    with pytest.raises(ChunkMismatch) as e:
        read(verified, depth=8, direct=direct)
    assert str(e.value).startswith(mismatch(staged, name, data, offset)), e.value
    with pytest.raises(ArtifactError) as refused:  # the pass before loading (Run:ai formats)
        verify_content(verified, workers=4)
    assert str(refused.value).startswith(
        "modelstage: refusing to load " + mismatch(staged, name, data, offset)
    ), refused.value


def test_a_corrupt_first_byte_is_refused_by_the_verify_phase_naming_chunk_0(
    s3: S3Server, staged: str
) -> None:
    name = "model-rank-1-part-0.safetensors"
    data = corrupt(s3, staged, name, 0)
    with pytest.raises(ArtifactError) as e:
        verify(staged)
    assert str(e.value).startswith(
        "modelstage: refusing to load " + mismatch(staged, name, data, 0)
    ), e.value


def test_verify_reads_every_object_in_parallel_chunks_and_names_the_bad_one(
    s3: S3Server, staged: str
) -> None:
    dest = open_artifact(staged, s3.options())
    manifest = verify_artifact(dest, hash_content=True)
    assert manifest.schemaVersion == 2
    name = "model-rank-0-part-0.safetensors"
    offset = 3 * CHUNK + 17
    data = corrupt(s3, staged, name, offset)
    verify_artifact(dest, hash_content=False)  # sizes alone cannot see it
    with pytest.raises(ArtifactError) as e:
        verify_artifact(dest, hash_content=True)
    assert re.fullmatch(
        re.escape(mismatch(staged, name, data, offset))
        + f"{HEX}; the file is corrupt: re-stage it",
        str(e.value),
    ), e.value


def test_a_rerun_rehashes_finished_objects_and_writes_a_corrupt_one_again(
    s3: S3Server, staged: str, multipart_ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Objects of a run whose manifest was never written are reused only if their bytes hash
    to the content hash their metadata records (the S3 completion check)."""
    raw = s3.client()
    manifest = Manifest.from_json(raw.get_object(Bucket=BUCKET, Key=key(staged, MANIFEST))
                                  ["Body"].read(), "m")  # fmt: skip
    raw.delete_object(Bucket=BUCKET, Key=key(staged, MANIFEST))  # a run killed before commit
    name = "model-rank-0-part-0.safetensors"
    corrupt(s3, staged, name, 5 * CHUNK + 1)
    capsys.readouterr()
    stage(StageRequest(source=str(multipart_ckpt), out=staged, tp=2,
                       format="runai_streamer_sharded", s3=s3.options(), chunk_bytes=CHUNK))  # fmt: skip
    err = capsys.readouterr().err
    assert f"s3: {staged}{name} does not hash to its recorded content hash; writing it again" in err
    assert "s3: reused" in err, "the intact objects were reused"
    again = verify_artifact(open_artifact(staged, s3.options()), hash_content=True)
    assert again.files == manifest.files
