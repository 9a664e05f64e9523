"""The loader plugin's own S3 reader against a real S3 server (SeaweedFS on 127.0.0.1): the
verify phase on S3 (manifest, listing, sizes, headers, ETags) and the pipelined reader's
ranged GETs into parameter memory, byte-exact against safetensors' own load of the same
rank files staged locally; faults: objects replaced after verification, cut connections.
vLLM itself loading through this reader is in ``test_s3_vllm.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from modelstage.core.errors import ArtifactError
from modelstage.core.manifest import MANIFEST
from modelstage.core.s3_client import S3Client
from modelstage.plugin.checks import VerifiedArtifact, verify_s3
from modelstage.plugin.reader import TORCH_DTYPES, PipelinedReader, Target, flat_bytes
from modelstage.plugin.settings import PluginSettings, serving_s3_options
from modelstage.plugin.stores import S3Objects, store_for
from modelstage.stager.stage import StageRequest, stage
from safetensors.torch import load_file
from support.fault_proxy import FaultProxy, fault_proxy
from support.s3_server import S3Server

MiB = 1024 * 1024
RANK1 = "model-rank-1-part-*.safetensors"
VLLM = "0.32.0"


@pytest.fixture(scope="module")
def staged(
    s3: S3Server, multipart_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, str]:
    """The checkpoint staged at TP=2 both to S3 (runai_streamer_sharded) and to a local
    directory (sharded_state: the same rank files); returns (uri, directory, digest)."""
    s3.create_bucket("plugin-reader")
    uri = "s3://plugin-reader/llm/"
    summary = stage(StageRequest(source=str(multipart_ckpt), out=uri, tp=2,
                                 format="runai_streamer_sharded", s3=s3.options()))  # fmt: skip
    local = tmp_path_factory.mktemp("reader") / "local"
    stage(StageRequest(source=str(multipart_ckpt), out=str(local), tp=2, format="sharded_state"))
    return uri, local, str(summary["digest"])


@pytest.fixture(autouse=True)
def pod_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment the operator gives a serving pod (credentials included: boto3 reads
    them from there, as in the pod)."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)


def client(endpoint: str | None = None) -> S3Client:
    """The client the plugin builds in a pod from that environment."""
    options = serving_s3_options()
    if endpoint:
        options = dataclasses.replace(options, endpoint_url=endpoint)
    return S3Client(options)


def verify(
    uri: str, s3: S3Client, *, digest: str | None = None, rank_glob: str = RANK1,
    content: bool = True,
) -> VerifiedArtifact:  # fmt: skip
    return verify_s3(
        uri,
        s3,
        load_format="runai_streamer_sharded",
        settings=PluginSettings(digest=digest, tp=2, verify=content),
        running_tp=2,
        vllm_version=VLLM,
        rank_glob=rank_glob,
    )


def read_all(
    verified: VerifiedArtifact, *, chunk: int, depth: int, direct: bool
) -> dict[str, torch.Tensor]:
    tensors = {
        name: torch.full(info.shape, float("nan"), dtype=TORCH_DTYPES[info.dtype])
        for f in verified.files
        for name, info in f.header.tensors.items()
    }
    reader = PipelinedReader(chunk_bytes=chunk, depth=depth, device=torch.device("cpu"),
                             direct=direct)  # fmt: skip
    store = store_for(verified)
    assert isinstance(store, S3Objects)
    reader.read(store, lambda info: Target(flat_bytes(tensors[info.name])))
    return tensors


def expected(local: Path) -> dict[str, torch.Tensor]:
    want: dict[str, torch.Tensor] = {}
    for path in sorted(local.glob(RANK1)):
        want.update(load_file(path))
    return want


@pytest.mark.parametrize(("chunk", "depth", "direct"),
                         [(8 * MiB, 8, True), (MiB + 4099, 3, True), (3 * MiB + 1, 2, False)])  # fmt: skip
def test_s3_reader_fills_every_tensor_byte_exact(
    s3: S3Server, staged: tuple[str, Path, str], chunk: int, depth: int, direct: bool
) -> None:
    uri, local, digest = staged
    verified = verify(uri, client(), digest=digest)
    assert [f.name for f in verified.files] == sorted(p.name for p in local.glob(RANK1))
    assert all(f.etag for f in verified.files)
    got, want = read_all(verified, chunk=chunk, depth=depth, direct=direct), expected(local)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_verify_refuses_what_is_not_the_rolled_out_artifact(
    s3: S3Server, staged: tuple[str, Path, str]
) -> None:
    uri = staged[0]
    c = client()
    with pytest.raises(ArtifactError, match=f"no {MANIFEST}: the artifact is incomplete"):
        verify("s3://plugin-reader/elsewhere/", c)
    with pytest.raises(ArtifactError, match="digest"):
        verify(uri, c, digest="0" * 64)
    with pytest.raises(ArtifactError, match="lists no file matching"):
        verify(uri, c, rank_glob="model-rank-7-part-*.safetensors")


@pytest.fixture
def copy_of(s3: S3Server, staged: tuple[str, Path, str], request: pytest.FixtureRequest) -> str:
    """A private copy of the staged artifact that a test may damage."""
    source = staged[0].removeprefix("s3://plugin-reader/")
    prefix = f"copies/{request.node.name}/"
    raw = s3.client()
    for obj in raw.list_objects_v2(Bucket="plugin-reader", Prefix=source)["Contents"]:
        name = obj["Key"][len(source) :]
        raw.copy_object(Bucket="plugin-reader", Key=prefix + name,
                        CopySource={"Bucket": "plugin-reader", "Key": obj["Key"]})  # fmt: skip
    return f"s3://plugin-reader/{prefix}"


def key(uri: str, name: str) -> str:
    return uri.removeprefix("s3://plugin-reader/") + name


def test_missing_resized_or_unlisted_objects_are_refused_naming_them(
    s3: S3Server, copy_of: str
) -> None:
    raw, c = s3.client(), client()
    verified = verify(copy_of, c)
    first, second = verified.files[0], verified.files[-1]
    raw.put_object(Bucket="plugin-reader", Key=key(copy_of, "model-rank-1-part-99.safetensors"),
                   Body=b"x")  # fmt: skip
    with pytest.raises(ArtifactError, match=r"part-99.safetensors match .* not in the manifest"):
        verify(copy_of, c)
    raw.delete_object(Bucket="plugin-reader", Key=key(copy_of, "model-rank-1-part-99.safetensors"))
    raw.put_object(Bucket="plugin-reader", Key=key(copy_of, second.name), Body=b"short")
    with pytest.raises(ArtifactError, match=f"{second.name}: 5 bytes, the manifest says"):
        verify(copy_of, c)
    raw.delete_object(Bucket="plugin-reader", Key=key(copy_of, first.name))
    with pytest.raises(ArtifactError, match=f"{first.name}: listed in the manifest but missing"):
        verify(copy_of, c)


def test_an_object_replaced_after_verification_fails_the_read_by_its_etag(
    s3: S3Server, copy_of: str
) -> None:
    verified = verify(copy_of, client(), content=False)  # verifying keeps what it checked
    target = verified.files[-1]
    raw = s3.client()
    data = bytearray(raw.get_object(Bucket="plugin-reader", Key=key(copy_of, target.name))
                     ["Body"].read())  # fmt: skip
    data[-1] ^= 0xFF  # same size, other content: only the ETag tells
    raw.put_object(Bucket="plugin-reader", Key=key(copy_of, target.name), Body=bytes(data))
    with pytest.raises(ArtifactError, match=f"{target.name}: the object changed after it was "
                       "verified"):  # fmt: skip
        read_all(verified, chunk=8 * MiB, depth=4, direct=True)


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    with fault_proxy(s3.endpoint) as p:
        yield p


def test_connections_cut_mid_body_are_retried_and_every_byte_lands(
    s3: S3Server, staged: tuple[str, Path, str], proxy: FaultProxy
) -> None:
    uri, local, _ = staged
    verified = verify(uri, client(proxy.endpoint))
    for cut in (2 * MiB, 7 * MiB):
        proxy.cut_after_bytes(proxy.bytes_down + proxy.bytes_up + cut)
        got = read_all(verified, chunk=4 * MiB, depth=4, direct=True)
        for name, tensor in expected(local).items():
            assert torch.equal(got[name], tensor), name


def test_errors_name_the_object_and_never_the_secret(
    s3: S3Server, staged: tuple[str, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + s3.secret_key)
    with pytest.raises(ArtifactError) as refused:
        verify(staged[0], client())
    message = str(refused.value)
    assert "s3://plugin-reader/llm/" in message and "SignatureDoesNotMatch" in message
    assert s3.secret_key not in message and s3.access_key not in message


def test_serving_options_follow_the_operator_environment() -> None:
    options = serving_s3_options({
        "RUNAI_STREAMER_S3_ENDPOINT": "http://runai:9000",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        "AWS_REGION": "eu-west-1",
        "AWS_CA_BUNDLE": "/etc/ca.pem",
    })  # fmt: skip
    assert (options.endpoint_url, options.path_style, options.region, options.ca_bundle) == (
        "http://runai:9000", True, "eu-west-1", "/etc/ca.pem")  # fmt: skip
    both = serving_s3_options(
        {"AWS_ENDPOINT_URL": "http://aws:1", "RUNAI_STREAMER_S3_ENDPOINT": "x"}
    )
    assert both.endpoint_url == "http://aws:1" and not both.path_style
