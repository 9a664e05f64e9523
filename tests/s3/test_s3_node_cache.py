"""A serving pod of an S3 artifact on a node holding a copy (SeaweedFS on 127.0.0.1).

The node copy is a local directory (the pod's mount of its copy), so the plugin's S3 reader
takes it with the local reader when its manifest is the canonical form of the S3 manifest
object; ``prepare --node-cache`` says hit or miss the same way; a copy that is not the artifact
is a miss and the objects are read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from modelstage.core.manifest import MANIFEST
from modelstage.core.node_cache import canonical_manifest
from modelstage.plugin import sharded_state
from modelstage.plugin.reader import TORCH_DTYPES, PipelinedReader, Target, flat_bytes
from modelstage.plugin.s3_sharded_state import ModelstageS3ShardedStateLoader
from modelstage.plugin.settings import PluginSettings
from modelstage.plugin.stores import LocalFiles, S3Objects, store_for
from modelstage.stager.prepare import node_cache_verdict
from modelstage.stager.stage import StageRequest, stage
from safetensors.torch import load_file
from support.s3_server import S3Server

RANK1 = "model-rank-1-part-*.safetensors"


@pytest.fixture
def staged(s3: S3Server, bucket: str, make_small_ckpt: Path) -> tuple[str, str]:
    uri = f"s3://{bucket}/llm/"
    summary = stage(StageRequest(source=str(make_small_ckpt), out=uri, tp=2,
                                 format="runai_streamer_sharded", s3=s3.options()))  # fmt: skip
    return uri, str(summary["digest"])


@pytest.fixture
def node(s3: S3Server, bucket: str, staged: tuple[str, str], tmp_path: Path) -> Path:
    """This node's copy as the pod mounts it: the objects' bytes, the canonical manifest
    (what the agent keeps of a copy Job's stream)."""
    copy = tmp_path / "node-copy"
    copy.mkdir(parents=True)
    client = s3.client()
    for obj in client.list_objects_v2(Bucket=bucket, Prefix="llm/")["Contents"]:
        body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        (copy / obj["Key"].removeprefix("llm/")).write_bytes(body)
    (copy / MANIFEST).write_bytes(canonical_manifest((copy / MANIFEST).read_bytes()))
    return copy


@pytest.fixture(autouse=True)
def pod_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving pod's S3 environment, and rank 1's glob as vLLM renders it."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sharded_state, "rank_file_glob", lambda stock: RANK1)


def s3_loader(node: Path, digest: str) -> ModelstageS3ShardedStateLoader:
    instance = object.__new__(ModelstageS3ShardedStateLoader)
    instance.settings = PluginSettings(digest=digest, tp=2, node_cache=str(node))
    instance.stock = object.__new__(ModelstageS3ShardedStateLoader.stock_class)
    return instance


def read_rank(store: LocalFiles | S3Objects) -> dict[str, torch.Tensor]:
    dest = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
            for h in store.headers for n, t in h.tensors.items()}  # fmt: skip
    reader = PipelinedReader(chunk_bytes=1 << 20, depth=2, device=torch.device("cpu"))
    reader.read(store, lambda info: Target(flat_bytes(dest[info.name])))
    return dest


def test_an_s3_artifacts_node_copy_is_read_by_the_local_reader(
    s3: S3Server, staged: tuple[str, str], node: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.modelstage")
    uri, digest = staged
    copy = node
    verdict = node_cache_verdict(uri, digest, node, s3.options())
    assert verdict.summary() == {"result": "hit", "path": str(copy)}

    verified = s3_loader(node, digest).verify(uri, 2, "0.32.0")
    assert verified.node_cache == "hit" and verified.location == str(copy)
    store = store_for(verified)
    assert isinstance(store, LocalFiles) and verified.s3 is None
    assert (
        f"node cache hit: reading this rank's files from the node-local copy {copy}" in caplog.text
    )
    got = read_rank(store)
    want: dict[str, torch.Tensor] = {}
    for path in sorted(copy.glob(RANK1)):
        want.update(load_file(path))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def test_a_copy_that_is_not_the_s3_artifact_is_a_miss_and_the_objects_are_read(
    s3: S3Server, staged: tuple[str, str], node: Path
) -> None:
    uri, digest = staged
    manifest = node / MANIFEST
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(doc, indent=1))  # same content, other bytes: not trusted
    verdict = node_cache_verdict(uri, digest, node, s3.options())
    assert not verdict.hit and "is not the artifact's manifest" in verdict.reason

    verified = s3_loader(node, digest).verify(uri, 2, "0.32.0")
    assert verified.node_cache == "miss" and verified.location == uri
    assert isinstance(store_for(verified), S3Objects)
