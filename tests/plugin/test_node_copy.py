"""The serving pod and a node-local copy of its artifact, without vLLM running.

``modelstage prepare --node-cache DIR`` says hit or miss (with the reason) and never fails the
pod because of the cache; the loader plugin reads this rank's files from the node copy exactly
when prepare would say hit, else the artifact, and says which in its log and metrics. The copy
is trusted only when its manifest equals the artifact's byte for byte: a poisoned copy with a
self-consistent manifest of its own is a miss. A copy that is trusted and then fails a chunk
check is never served: the error is logged and the artifact read instead
(tests/serving/test_node_cache_vllm.py in vLLM).
"""

from __future__ import annotations

import json
import logging
import shutil
import urllib.request
from pathlib import Path

import pytest
import torch
from modelstage.core.integrity import ChunkMismatch, digest_bytes
from modelstage.core.location import verify_directory
from modelstage.core.manifest import MANIFEST, FileEntry, read_manifest
from modelstage.core.node_cache import POD_MOUNT, canonical_manifest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.plugin import sharded_state
from modelstage.plugin.checks import VerifiedArtifact, content_checker
from modelstage.plugin.metrics import LoadRecord, publish
from modelstage.plugin.node_copy import MAX_REASON, choose_node_copy
from modelstage.plugin.reader import TORCH_DTYPES, PipelinedReader, Target, flat_bytes
from modelstage.plugin.runai_streamer_sharded import ModelstageRunaiStreamerShardedLoader
from modelstage.plugin.settings import PluginSettings
from modelstage.plugin.sharded_state import ModelstageShardedStateLoader
from modelstage.stager.prepare import node_cache_verdict
from modelstage.stager.stage import StageRequest, stage
from plugin.test_reader_verify import flip
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file
from support.serving import free_ports, last_line, prepare_cli

CHUNK = 64 * 1024
RANK0 = "model-rank-0-part-*.safetensors"
VICTIM = "model-rank-0-part-0.safetensors"


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A TP=2 artifact hashed in 64 KiB chunks (each rank file has dozens): (dir, digest)."""
    root = tmp_path_factory.mktemp("node-copy")
    src = write_checkpoint(SyntheticModel(num_shards=2, split_fused=True, seed=11), root / "ckpt")
    summary = stage(StageRequest(source=str(src), out=str(root / "a"), tp=2, chunk_bytes=CHUNK))
    return root / "a", str(summary["digest"])


@pytest.fixture
def artifact(staged: tuple[Path, str], tmp_path: Path) -> Path:
    """A copy of the artifact this test may damage (the PVC's)."""
    return Path(shutil.copytree(staged[0], tmp_path / "pvc" / "artifact"))


@pytest.fixture
def node(staged: tuple[Path, str], tmp_path: Path) -> Path:
    """This node's copy of the artifact as a serving pod mounts it: the agent's copy (the
    artifact's files, its canonical manifest), here writable so that a test may damage it."""
    copy = tmp_path / "node-copy"
    shutil.copytree(staged[0], copy)
    (copy / MANIFEST).write_bytes(canonical_manifest((staged[0] / MANIFEST).read_bytes()))
    return copy


def middle(path: Path) -> int:
    return (path.stat().st_size // CHUNK // 2) * CHUNK + 123


def poison(directory: Path) -> None:
    """Change a rank file and rewrite the manifest to match it: a copy that verifies against
    its own manifest, but is not the artifact."""
    victim = directory / VICTIM
    flip(victim, middle(victim))
    doc = json.loads((directory / MANIFEST).read_text())
    entry = FileEntry.of(digest_bytes(victim.read_bytes(), CHUNK))
    doc["files"][VICTIM] = entry.to_doc()
    (directory / MANIFEST).write_text(json.dumps(doc))


# --- prepare ---------------------------------------------------------------------------------


def run_prepare(artifact: Path, digest: str, tmp: Path, *extra: str) -> tuple[int, str]:
    proc = prepare_cli("--artifact", str(artifact), "--digest", digest, "--tp", "2",
                       "--plugin-dir", str(tmp / "plugins"), *extra, cwd=tmp)  # fmt: skip
    return proc.returncode, last_line(proc)


def test_prepare_says_hit_when_the_node_copy_is_the_artifact(
    staged: tuple[Path, str], node: Path, tmp_path: Path
) -> None:
    directory, digest = staged
    code, line = run_prepare(directory, digest, tmp_path, "--node-cache", str(node))
    assert code == 0, line
    summary = json.loads(line)
    assert summary["nodeCache"] == {"result": "hit", "path": str(node)}
    assert summary["digest"] == digest and (tmp_path / "plugins" / "modelstage").is_dir()


def test_prepare_without_the_flag_says_nothing_of_a_node_cache(
    staged: tuple[Path, str], tmp_path: Path
) -> None:
    code, line = run_prepare(*staged, tmp_path)
    assert code == 0 and "nodeCache" not in json.loads(line), line


def test_prepare_says_miss_with_the_reason_and_the_pod_still_starts(
    staged: tuple[Path, str], node: Path, tmp_path: Path
) -> None:
    """A poisoned copy: the pod's verdict is a miss, exit 0, the plugin installed."""
    directory, digest = staged
    poison(node)
    code, line = run_prepare(directory, digest, tmp_path, "--node-cache", str(node))
    assert code == 0, line
    verdict = json.loads(line)["nodeCache"]
    assert (
        verdict["result"] == "miss" and "is not the artifact's manifest" in verdict["reason"]
    )
    assert (tmp_path / "plugins" / "modelstage").is_dir()


def test_a_poisoned_copy_with_a_self_consistent_manifest_is_a_miss(
    staged: tuple[Path, str], node: Path
) -> None:
    directory, digest = staged
    copy = node
    poison(copy)
    verify_directory(copy, digest=digest, tp=2)  # it verifies against its own manifest
    verdict = node_cache_verdict(str(directory), digest, node)
    assert not verdict.hit and verdict.reason == (
        f"{copy}/{MANIFEST} is not the artifact's manifest; the node copy is not this "
        "artifact"
    )


def drop_manifest(copy: Path) -> None:
    (copy / MANIFEST).unlink()


def drop_file(copy: Path) -> None:
    (copy / VICTIM).unlink()


def truncate(copy: Path) -> None:
    with open(copy / VICTIM, "r+b") as f:
        f.truncate(1000)


def add_file(copy: Path) -> None:
    (copy / "model-rank-0-part-9.safetensors").write_bytes(b"x")


def other_artifact(copy: Path) -> None:
    doc = json.loads((copy / MANIFEST).read_text())
    doc["tensorParallelSize"] = 4  # an artifact of the same source at another TP, say
    (copy / MANIFEST).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (drop_manifest, "{copy}: no modelstage.json; the copy is incomplete"),
        (drop_file, "{copy}/" + VICTIM + ": listed in the manifest but missing"),
        (truncate, "{copy}/" + VICTIM + ": 1000 bytes, the manifest says {size}"),
        (add_file, "{copy}: files not in the manifest: model-rank-0-part-9.safetensors"),
        (other_artifact, "{copy}/modelstage.json is not the artifact's manifest; the node "
                         "copy is not this artifact"),
    ],
)  # fmt: skip
def test_a_partial_or_damaged_copy_is_a_miss_naming_what_is_wrong(
    staged: tuple[Path, str], node: Path, damage: object, reason: str
) -> None:
    directory, digest = staged
    copy = node
    size = (copy / VICTIM).stat().st_size
    damage(copy)  # type: ignore[operator]
    verdict = node_cache_verdict(str(directory), digest, node)
    assert not verdict.hit and verdict.reason == reason.format(copy=copy, size=size)
    assert verdict.summary() == {"result": "miss", "reason": verdict.reason}


def test_no_copy_mounted_or_an_empty_mount_are_misses(
    staged: tuple[Path, str], tmp_path: Path
) -> None:
    directory, digest = staged
    mount = tmp_path / "node-copy"
    assert (
        node_cache_verdict(str(directory), digest, mount).reason == f"{mount}: no node copy mounted"
    )
    mount.mkdir()
    assert node_cache_verdict(str(directory), digest, mount).reason == (
        f"{mount}: no {MANIFEST}; the copy is incomplete"
    )


def test_a_copy_holding_the_artifacts_manifest_as_it_is_is_a_miss(
    staged: tuple[Path, str], node: Path
) -> None:
    """Only the canonical form the agent writes is a copy: the bytes of the artifact's own
    manifest (its timing fields in) are not what an agent published."""
    directory, digest = staged
    shutil.copy(directory / MANIFEST, node / MANIFEST)
    verdict = node_cache_verdict(str(directory), digest, node)
    assert not verdict.hit and "is not the artifact's manifest" in verdict.reason


def test_an_unreadable_artifact_is_a_miss_and_reasons_stay_short(
    staged: tuple[Path, str], node: Path, tmp_path: Path
) -> None:
    """prepare's own checks refuse such an artifact first; the verdict alone never raises."""
    _, digest = staged
    verdict = node_cache_verdict(str(tmp_path / "gone"), digest, node)
    assert verdict.reason == "the artifact has no manifest to compare the node copy with"
    verdict = node_cache_verdict(str(tmp_path / ("x" * 500)), digest, node)
    assert verdict.reason.startswith("cannot read the artifact's manifest: [Errno 36]")
    assert len(verdict.reason) == MAX_REASON and not verdict.hit


# --- the loader plugin's choice ----------------------------------------------------------


def loader(
    cls: type[ModelstageShardedStateLoader], settings: PluginSettings
) -> ModelstageShardedStateLoader:
    """A loader with only what ``verify`` uses (vLLM's config objects not needed)."""
    instance = object.__new__(cls)
    instance.settings = settings
    instance.stock = object.__new__(cls.stock_class)
    return instance


@pytest.fixture(autouse=True)
def rank0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's glob, as vLLM renders it once its parallel groups exist."""
    monkeypatch.setattr(sharded_state, "rank_file_glob", lambda stock: RANK0)


def settings(node: Path, digest: str) -> PluginSettings:
    return PluginSettings(digest=digest, tp=2, node_cache=str(node))


def read_rank(verified: VerifiedArtifact) -> dict[str, torch.Tensor]:
    """What the sharded-state loader's transfer does, into fresh tensors, verifying."""
    checker = content_checker(verified)
    assert checker is not None
    files = [(f.path, f.header) for f in verified.files]
    dest = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
            for _, h in files for n, t in h.tensors.items()}  # fmt: skip
    reader = PipelinedReader(chunk_bytes=CHUNK, depth=1, device=torch.device("cpu"))
    reader.read(files, lambda info: Target(flat_bytes(dest[info.name])), checker)
    return dest


def test_a_hit_reads_the_node_copy_so_a_damaged_artifact_does_not_matter(
    staged: tuple[Path, str], artifact: Path, node: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.modelstage")
    _, digest = staged
    victim = artifact / VICTIM
    flip(victim, middle(victim))  # the PVC's bytes are wrong; its manifest is the artifact's
    ld = loader(ModelstageShardedStateLoader, settings(node, digest))
    verified = ld.verify(str(artifact), 2, "0.32.0")
    copy = node
    assert verified.node_cache == "hit" and verified.location == str(copy)
    assert {f.path.parent for f in verified.files} == {copy} and verified.s3 is None
    assert (
        f"node cache hit: reading this rank's files from the node-local copy {copy}" in caplog.text
    )
    got = read_rank(verified)
    want = load_file(staged[0] / VICTIM)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


@pytest.mark.parametrize("case", ["absent", "poisoned", "partial"])
def test_a_miss_reads_the_artifact_and_says_why(
    staged: tuple[Path, str],
    artifact: Path,
    node: Path,
    case: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.modelstage")
    _, digest = staged
    copy = node
    if case == "absent":
        shutil.rmtree(copy)
    elif case == "poisoned":
        poison(copy)
    else:
        truncate(copy)
    verified = loader(ModelstageShardedStateLoader, settings(node, digest)).verify(
        str(artifact), 2, "0.32.0"
    )
    assert verified.node_cache == "miss" and verified.location == str(artifact)
    assert {f.path.parent for f in verified.files} == {artifact}
    assert f"node cache miss: reading {artifact} (" in caplog.text
    read_rank(verified)  # the artifact, verified as it streams


def test_a_trusted_copy_with_a_flipped_byte_fails_its_chunk_check_and_is_read_past(
    staged: tuple[Path, str], artifact: Path, node: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Equal manifests, so it is a hit; the chunk check then catches the flipped byte in the
    node's file. The loader's transfer then reads the artifact instead (in vLLM:
    tests/serving/test_node_cache_vllm.py), logging this error, which names the node file,
    the chunk and the remedy."""
    _, digest = staged
    victim = node / VICTIM
    flip(victim, middle(victim))
    verified = loader(ModelstageShardedStateLoader, settings(node, digest)).verify(
        str(artifact), 2, "0.32.0"
    )
    assert verified.node_cache == "hit"
    with pytest.raises(ChunkMismatch) as e:
        read_rank(verified)
    assert e.value.where == str(victim)
    detail = f"{e.value.where}: {e.value.reason}"
    assert sharded_state.corrupt_node_copy(detail, node) == "corrupt"
    (logged,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert logged.getMessage() == (
        f"modelstage: node cache: {detail}: the node-local copy {node} is "
        "corrupt: the node agent's re-verification drops it and a copy Job copies it again; "
        "reading the artifact instead"
    )


def test_a_trusted_copy_with_a_corrupt_header_chunk_is_read_past_at_verify(
    staged: tuple[Path, str], artifact: Path, node: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The header's chunk is checked at verify: the node copy fails it, the error is logged,
    and the verified files are the artifact's (``corrupt``), read and checked as they stream."""
    _, digest = staged
    copy = node
    flip(copy / VICTIM, 0)
    verified = loader(ModelstageShardedStateLoader, settings(node, digest)).verify(
        str(artifact), 2, "0.32.0"
    )
    assert verified.node_cache == "corrupt" and verified.location == str(artifact)
    assert {f.path.parent for f in verified.files} == {artifact}
    (logged,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert logged.getMessage().startswith(f"modelstage: node cache: {copy / VICTIM}: chunk 0 ")
    assert logged.getMessage().endswith(
        f"the file is corrupt: the node-local copy {copy} is corrupt: the node agent's "
        "re-verification drops it and a copy Job copies it again; reading the artifact instead"
    )
    want = load_file(staged[0] / VICTIM)
    got = read_rank(verified)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def test_without_a_node_cache_nothing_changes(staged: tuple[Path, str], artifact: Path) -> None:
    verified = loader(ModelstageShardedStateLoader, PluginSettings(digest=staged[1])).verify(
        str(artifact), 2, "0.32.0"
    )
    assert verified.node_cache == "" and verified.location == str(artifact)


def test_a_format_read_by_vllms_own_reader_never_takes_the_node_copy(
    staged: tuple[Path, str], artifact: Path, node: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's Run:ai streamer reads ``--model`` itself: the node copy could not be what it
    loads, so it is a miss, said as such."""
    caplog.set_level(logging.INFO, logger="vllm.modelstage")
    runai = loader(ModelstageRunaiStreamerShardedLoader, settings(node, staged[1]))  # type: ignore[arg-type]
    verified = runai.verify(str(artifact), 2, "0.32.0")
    assert verified.location == str(artifact)
    assert runai._node_cache(verified) == "miss"
    assert "node cache miss: --load-format modelstage_runai_streamer_sharded reads" in caplog.text


def test_the_choice_for_another_scheme_is_a_miss(staged: tuple[Path, str], node: Path) -> None:
    got = choose_node_copy(node, staged[1], "pvc://models/x")
    assert not got.hit and got.reason == "no node copy for a pvc:// artifact"


def test_each_load_is_counted_by_its_node_cache_result() -> None:
    base = free_ports(4)
    for result in ("hit", "hit", "miss"):
        record = LoadRecord(rank=3, tensor_parallel_size=4, load_format="modelstage_sharded_state",
                            artifact="a", node_cache=result)  # fmt: skip
        publish(record, port=base, addr="127.0.0.1")
    assert '"node_cache":"miss"' in record.log_line()
    with urllib.request.urlopen(f"http://127.0.0.1:{base + 3}/metrics", timeout=5) as r:
        text = r.read().decode()
    counts = {s.labels["result"]: s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == "modelstage_node_cache_load_total"
              and s.labels.get("rank") == "3"}  # fmt: skip
    assert counts == {"hit": 2, "miss": 1}


def test_the_fixture_artifact_has_small_chunks(staged: tuple[Path, str]) -> None:
    manifest = read_manifest(staged[0])
    assert manifest is not None
    digest = manifest.files[VICTIM].digest
    assert digest is not None and len(digest.chunks) > 4


def test_the_node_cache_root_comes_from_the_pods_environment() -> None:
    env = {"MODELSTAGE_NODE_CACHE": POD_MOUNT}
    assert PluginSettings.from_env(env).node_cache == POD_MOUNT
    assert PluginSettings.from_env({}).node_cache is None


def test_without_an_expected_digest_the_copy_is_looked_up_by_the_artifacts_own(
    staged: tuple[Path, str], artifact: Path, node: Path
) -> None:
    unpinned = PluginSettings(tp=2, node_cache=str(node))
    verified = loader(ModelstageShardedStateLoader, unpinned).verify(str(artifact), 2, "0.32.0")
    assert verified.node_cache == "hit" and verified.location == str(node)
