"""The pipelined reader verifying while it streams: every byte of every rank file is read and
hashed against the manifest's chunk hashes as it lands, and a same-size corruption anywhere
(the header's first byte, a hole between tensors, a middle chunk, the last byte) fails the read
naming the file, the chunk and both hashes. Also the loader's choice of how to verify, and that
turning verification off is never silent."""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
import torch
from modelstage.core.errors import ArtifactError
from modelstage.core.integrity import ChunkChecker, ChunkMismatch, digest_bytes
from modelstage.core.manifest import MANIFEST, read_manifest
from modelstage.core.safetensors_format import TensorInfo, read_local_header
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.plugin.base import OFF, PASS, STREAM
from modelstage.plugin.checks import VerifiedArtifact, content_checker, verify_local
from modelstage.plugin.metrics import LoadRecord, publish
from modelstage.plugin.reader import TORCH_DTYPES, PipelinedReader, Target, flat_bytes
from modelstage.plugin.runai_streamer_sharded import ModelstageRunaiStreamerShardedLoader
from modelstage.plugin.settings import PluginSettings
from modelstage.plugin.sharded_state import ModelstageShardedStateLoader
from modelstage.stager.stage import StageRequest, stage
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file
from support.schema1 import downgrade_to_schema1
from support.serving import free_ports

CPU = torch.device("cpu")
CHUNK = 64 * 1024
RANK1 = "model-rank-1-part-*.safetensors"


@pytest.fixture(scope="module")
def small_chunks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TP=2 artifact hashed in 64 KiB chunks: each rank file has about fifty."""
    root = tmp_path_factory.mktemp("chunked")
    src = write_checkpoint(SyntheticModel(num_shards=2, split_fused=True, seed=5), root / "ckpt")
    stage(StageRequest(source=str(src), out=str(root / "a"), tp=2, chunk_bytes=CHUNK))
    return root / "a"


@pytest.fixture
def artifact(small_chunks: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(small_chunks, tmp_path / "a"))


def verify(directory: Path, settings: PluginSettings | None = None) -> VerifiedArtifact:
    return verify_local(directory, load_format="modelstage_sharded_state",
                        settings=settings or PluginSettings(), running_tp=2,
                        vllm_version="0.32.0", rank_glob=RANK1)  # fmt: skip


def read(
    verified: VerifiedArtifact, read_bytes: int, depth: int, direct: bool
) -> dict[str, torch.Tensor]:
    """What the sharded-state loader does, into fresh tensors; returns them."""
    checker = content_checker(verified)
    assert checker is not None
    files = [(f.path, f.header) for f in verified.files]
    dest = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
            for _, h in files for n, t in h.tensors.items()}  # fmt: skip
    reader = PipelinedReader(chunk_bytes=checker.read_bytes(read_bytes), depth=depth, device=CPU,
                             direct=direct)  # fmt: skip
    stats = reader.read(files, lambda info: Target(flat_bytes(dest[info.name])), checker)
    size = sum(f.size for f in verified.files)
    assert stats.bytes == size and checker.stats.bytes == size, "every byte read and hashed"
    return dest


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


MODES = [(1, 2, True), (3 * CHUNK + 5, 3, True), (1 << 26, 1, True), (1, 2, False),
         (2 * CHUNK, 4, False)]  # fmt: skip
"""(wanted read size, depth, direct): reads of one chunk, of several, of the whole file; the
host path (reads into the parameters) and the buffered CUDA path (run here without streams)."""


@pytest.mark.parametrize(("read_bytes", "depth", "direct"), MODES)
def test_verified_reads_fill_every_tensor_exactly(
    small_chunks: Path, read_bytes: int, depth: int, direct: bool
) -> None:
    verified = verify(small_chunks)
    dest = read(verified, read_bytes, depth, direct)
    want = load_file(verified.files[0].path)
    assert sorted(dest) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(dest[name], tensor), name


def positions(path: Path) -> dict[str, int]:
    header = read_local_header(path)
    size = path.stat().st_size
    assert size > 4 * CHUNK
    middle = (size // CHUNK // 2) * CHUNK + 123
    inside = next(t for t in header.tensors.values() if t.begin <= middle < t.end)
    assert inside.nbytes, "the middle chunk's byte belongs to a tensor"
    return {"first byte": 0, "middle chunk": middle, "last byte": size - 1}


@pytest.mark.parametrize("where", ["middle chunk", "last byte"])
@pytest.mark.parametrize(("read_bytes", "depth", "direct"), MODES)
def test_a_same_size_corruption_fails_the_read_naming_file_chunk_and_hashes(
    artifact: Path, where: str, read_bytes: int, depth: int, direct: bool
) -> None:
    victim = artifact / "model-rank-1-part-0.safetensors"
    offset = positions(victim)[where]
    verified = verify(artifact)  # before the damage: what the verify phase saw
    flip(victim, offset)
    with pytest.raises(ChunkMismatch) as e:
        read(verified, read_bytes, depth, direct)
    digest = read_manifest(artifact).files[victim.name].digest  # type: ignore[union-attr]
    assert digest is not None
    index = offset // CHUNK
    lo, hi = digest.range(index)
    data = victim.read_bytes()
    assert str(e.value) == (
        f"{victim}: chunk {index} (bytes {lo}-{hi - 1}) has BLAKE3 "
        f"{digest_bytes(data[lo:hi], CHUNK).chunks[0]}, the manifest says "
        f"{digest.chunks[index]}; the file is corrupt: re-stage it"
    )


def test_a_corrupt_header_is_refused_as_corrupt_before_it_plans_any_read(artifact: Path) -> None:
    """The first byte is the header's length: the verify phase checks the header's chunk
    before parsing it, so the refusal names the chunk instead of a parse error."""
    victim = artifact / "model-rank-1-part-0.safetensors"
    flip(victim, 0)
    with pytest.raises(ArtifactError) as e:
        verify(artifact)
    assert str(e.value).startswith(
        f"modelstage: refusing to load {victim}: chunk 0 (bytes 0-{CHUNK - 1}) has BLAKE3 "
    ), e.value
    assert str(e.value).endswith("; the file is corrupt: re-stage it")
    with pytest.raises(ArtifactError) as unverified:  # without chunk hashes: a parse error
        verify(artifact, PluginSettings(verify=False))
    assert "chunk" not in str(unverified.value)


def test_holes_between_tensors_and_bytes_after_the_last_are_read_and_hashed(
    tmp_path: Path,
) -> None:
    """safetensors allows gaps between tensors and the manifest covers every byte of the file:
    a reader that skipped the gaps would let a corruption there through."""
    entries, offset = {}, 0
    for i in range(1500):  # more pieces than one preadv takes (IOV_MAX)
        offset += 4 if i % 7 == 3 else 0
        entries[f"t{i}"] = {"dtype": "F32", "shape": [3], "data_offsets": [offset, offset + 12]}
        offset += 12
    raw = json.dumps(entries).encode()
    data = bytes(range(256)) * (offset // 256 + 1)
    blob = struct.pack("<Q", len(raw)) + raw + data[:offset] + b"trailing bytes"
    path = tmp_path / "holes.safetensors"
    path.write_bytes(blob)
    header = read_local_header(path)
    digest = digest_bytes(blob, 4096)
    hole = header.data_start + 3 * 12  # the first hole
    trailing = len(blob) - 3
    for direct in (True, False):
        for bad in (None, hole, trailing):
            path.write_bytes(blob)
            if bad is not None:
                flip(path, bad)
            checker = ChunkChecker([(str(path), digest)])
            dest = {n: torch.empty(3) for n in entries}

            def into(i: TensorInfo, dest: dict[str, torch.Tensor] = dest) -> Target:
                return Target(flat_bytes(dest[i.name]))

            reader = PipelinedReader(chunk_bytes=checker.read_bytes(8192), depth=2, device=CPU,
                                     direct=direct)  # fmt: skip
            if bad is None:
                reader.read([(path, header)], into, checker)
                assert checker.stats.bytes == len(blob)
                continue
            with pytest.raises(ChunkMismatch, match=rf"chunk {bad // 4096} "):
                reader.read([(path, header)], into, checker)


def test_a_schema_1_artifact_has_no_streaming_checker_and_fails_the_pass(artifact: Path) -> None:
    from modelstage.plugin.checks import verify_content

    downgrade_to_schema1(artifact)
    verified = verify(artifact)
    assert content_checker(verified) is None
    verify_content(verified)
    victim = artifact / "model-rank-1-part-0.safetensors"
    flip(victim, positions(victim)["middle chunk"])
    with pytest.raises(ArtifactError, match=rf"refusing to load {victim}: sha256 is [0-9a-f]{{64}}, "
                       r"the manifest says [0-9a-f]{64}; the file is corrupt"):  # fmt: skip
        verify_content(verify(artifact))


def loader(cls: type, settings: PluginSettings) -> ModelstageShardedStateLoader:
    """A loader with only what ``_verify_content`` uses (vLLM's config objects not needed)."""
    instance = object.__new__(cls)
    instance.settings = settings
    return instance  # type: ignore[no-any-return]


def test_how_each_load_verifies_and_that_off_is_never_silent(
    artifact: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.modelstage")
    verified = verify(artifact)
    record = LoadRecord(rank=0, tensor_parallel_size=2, load_format="x", artifact="a")
    on = PluginSettings()
    assert loader(ModelstageShardedStateLoader, on)._verify_content(verified, record) == STREAM
    assert "as it streams in" in caplog.text
    runai = loader(ModelstageRunaiStreamerShardedLoader, on)
    assert runai._verify_content(verified, record) == PASS  # vLLM's Run:ai reader moves the bytes
    assert record.verified_bytes == verified.bytes and "in a pass before loading" in caplog.text

    caplog.clear()
    off = loader(ModelstageShardedStateLoader, PluginSettings(verify=False))
    record = LoadRecord(rank=7, tensor_parallel_size=8, load_format="modelstage_sharded_state",
                        artifact="a", bytes=10, verification=off._verify_content(verified, record))  # fmt: skip
    assert record.verification == OFF
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "MODELSTAGE_VERIFY=0" in warning[0].getMessage()
    assert "WITHOUT verifying" in warning[0].getMessage()
    assert '"verification":"off"' in record.log_line()
    port = free_ports(8)
    publish(record, port=port, addr="127.0.0.1")
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port + 7}/metrics", timeout=5) as r:
        text = r.read().decode()
    modes = {s.labels["mode"]: s.value for f in text_string_to_metric_families(text)
             for s in f.samples if s.name == "modelstage_load_verification"
             and s.labels.get("rank") == "7"}  # fmt: skip
    assert modes == {"stream": 0, "pass": 0, "off": 1}


def test_the_manifest_of_the_fixture_is_schema_2_with_small_chunks(small_chunks: Path) -> None:
    doc = json.loads((small_chunks / MANIFEST).read_text())
    assert doc["schemaVersion"] == 2
    entry = doc["files"]["model-rank-1-part-0.safetensors"]
    assert entry["chunkBytes"] == CHUNK and len(entry["chunks"]) == -(-entry["size"] // CHUNK)


def test_without_blake3_a_verifying_load_is_refused_saying_how_to_go_on(
    small_chunks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "blake3", None)  # import fails
    with pytest.raises(ArtifactError) as e:
        verify(small_chunks)
    assert str(e.value) == (
        f"modelstage: refusing to load {small_chunks}: the blake3 package is not installed: it "
        "is needed to verify artifact content (`pip install blake3`; vLLM images have it); or "
        "set MODELSTAGE_VERIFY=0 to load it unverified"
    )
    assert verify(small_chunks, PluginSettings(verify=False)).files


@pytest.mark.parametrize("direct", [True, False])
def test_no_target_is_finished_before_the_chunks_holding_it_are_checked(
    small_chunks: Path, direct: bool
) -> None:
    """Reads smaller than a hash chunk (direct) or holding several (buffered): a tensor that
    needs a conversion is finished (copied into its parameter) only once every chunk with a
    byte of it hashed right."""
    verified = verify(small_chunks)
    checker = content_checker(verified)
    assert checker is not None
    checked: list[tuple[int, int]] = []
    original = checker.check

    def check(file: int, begin: int, views: list[memoryview]) -> None:
        original(file, begin, views)
        checked.append((begin, begin + sum(len(v) for v in views)))

    checker.check = check  # type: ignore[method-assign]
    late: list[str] = []

    def target(info: TensorInfo) -> Target:
        staging = torch.empty(info.nbytes, dtype=torch.uint8)

        def finish() -> None:
            covered = sorted(checked)
            at = info.begin - info.begin % CHUNK
            for lo, hi in covered:
                if lo <= at < hi:
                    at = hi
            if at < info.end:
                late.append(info.name)

        return Target(staging, finish)

    files = [(f.path, f.header) for f in verified.files]
    read_bytes = 16 * 1024 if direct else checker.read_bytes(3 * CHUNK)
    reader = PipelinedReader(chunk_bytes=read_bytes, depth=3, device=CPU, direct=direct)
    reader.read(files, target, checker)
    assert checker.stats.bytes == verified.bytes
    assert not late, f"finished before their chunks were checked: {late[:3]}"
