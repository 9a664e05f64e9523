"""``--format tensorizer --out s3://...`` against a real S3 server (SeaweedFS on 127.0.0.1),
read back the way vLLM reads it: tensorizer's ``open_stream`` (boto3 presigns, ``curl``
downloads) with the settings a serving pod has in its environment."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from modelstage.core.integrity import digest_bytes
from modelstage.core.location import open_artifact, verify
from modelstage.stager.stage import StageRequest, stage
from readback import MARKER, rank_file, sharded_state
from support.s3_server import S3Server
from tensorizer import TensorDeserializer
from tensorizer.stream_io import open_stream

MiB = 1024 * 1024
VLLM_STREAM_KWARGS = {"s3_access_key_id": None, "s3_secret_access_key": None, "s3_endpoint": None}
"""What vLLM 0.32's ``TensorizerArgs.stream_kwargs`` passes when the extra config names only
``tensorizer_uri``: tensorizer then resolves the endpoint and boto3 the credentials from the
pod's ``AWS_*`` variables (the ones the operator sets)."""


def request(src: Path, out: str, s3: S3Server, tp: int = 2) -> StageRequest:
    return StageRequest(source=str(src), out=out, tp=tp, format="tensorizer",
                        s3=s3.options(part_bytes=5 * MiB, concurrency=4))  # fmt: skip


@pytest.fixture
def pod_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.s3cfg, no ~/.aws of this machine


def test_rank_objects_equal_the_local_tensorizer_files_byte_for_byte(
    s3: S3Server, bucket: str, staged: Callable[..., Path], checkpoint: Callable[[str], Path]
) -> None:
    """The wide model's rank files exceed one 5 MiB part: multipart uploads, hashed on the way."""
    local = staged("wide", "tensorizer", 2)
    summary = stage(request(checkpoint("wide"), f"s3://{bucket}/art/", s3))
    assert summary["format"] == "tensorizer"
    client = s3.client()
    for rank in range(2):
        name = f"model-rank-{rank:03d}.tensors"
        obj = client.get_object(Bucket=bucket, Key=f"art/{name}")
        body = obj["Body"].read()
        assert len(body) > 5 * MiB
        assert body == rank_file(local, rank).read_bytes()
        assert obj["Metadata"]["blake3"] == digest_bytes(body).root
    manifest = verify(open_artifact(f"s3://{bucket}/art/", s3.options()), tp=2)
    assert manifest.format == "tensorizer"


@pytest.mark.usefixtures("pod_env")
@pytest.mark.parametrize(("model", "hold"), [("llama", None), ("mixtral", None), ("mixtral", 0)])
def test_tensorizers_own_s3_reader_loads_each_rank_file_like_vllm_does(
    s3: S3Server, bucket: str, staged: Callable[..., Path], checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch, model: str, hold: int | None,
) -> None:  # fmt: skip
    """Mixtral: each rank's stacked experts, streamed into the multipart upload; ``hold=0``:
    every tensor read twice (hashed, then written), as an expert stack too large to hold is."""
    if hold is not None:
        from modelstage.stager.writers import tensorizer as tensorizer_writer

        monkeypatch.setattr(tensorizer_writer, "HOLD_BYTES", hold)
    stage(request(checkpoint(model), f"s3://{bucket}/m", s3))
    reference = staged(model, "sharded_state", 2)
    for rank in range(2):
        uri = f"s3://{bucket}/m/model-rank-{rank:03d}.tensors"
        with (
            open_stream(uri, mode="rb", **VLLM_STREAM_KWARGS) as stream,
            TensorDeserializer(stream, device="cpu") as loaded,
        ):
            assert MARKER in loaded
            expected = sharded_state(reference, rank)
            assert set(loaded.keys()) == set(expected) | {MARKER}
            for name, tensor in expected.items():
                assert torch.equal(loaded[name], tensor), f"rank {rank}: {name}"


def test_a_rerun_reuses_the_finished_rank_objects(
    s3: S3Server, bucket: str, checkpoint: Callable[[str], Path], capfd: pytest.CaptureFixture[str]
) -> None:
    out = f"s3://{bucket}/r"
    stage(request(checkpoint("llama"), out, s3))
    client = s3.client()
    client.delete_object(Bucket=bucket, Key="r/modelstage.json")
    client.delete_object(Bucket=bucket, Key="r/model-rank-001.tensors")
    capfd.readouterr()
    summary = stage(request(checkpoint("llama"), out, s3))
    assert summary["alreadyStaged"] is False
    assert "s3: reused" in capfd.readouterr().err
    verify(open_artifact(out, s3.options()), tp=2, hash_content=True)


def test_nothing_is_spooled_on_local_disk(
    s3: S3Server, bucket: str, staged: Callable[..., Path], checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Each rank file streams into its multipart upload: no temporary file (in a Job, TMPDIR
    is the scratch volume, which would have to hold the whole artifact)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/modelstage-no-spool")
    stage(request(checkpoint("wide"), f"s3://{bucket}/nospool/", s3))
    local = staged("wide", "tensorizer", 2)
    client = s3.client()
    for rank in range(2):
        body = client.get_object(Bucket=bucket, Key=f"nospool/model-rank-{rank:03d}.tensors")
        assert body["Body"].read() == rank_file(local, rank).read_bytes()
