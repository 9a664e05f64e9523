"""The loader's verify phase without vLLM: each refusal names the problem and what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from modelstage.core.errors import ArtifactError, SpecError
from modelstage.core.manifest import MANIFEST
from modelstage.plugin.checks import (
    VerifiedArtifact,
    _part_key,
    content_checker,
    verify_content,
    verify_local,
)
from modelstage.plugin.settings import PluginSettings
from support.serving import TIED, Artifact, stage_artifact

RANK0 = "model-rank-0-part-*.safetensors"


def verify(
    directory: Path,
    *,
    tp: int = 2,
    settings: PluginSettings | None = None,
    load_format: str = "modelstage_sharded_state",
    vllm_version: str = "0.32.0",
    rank_glob: str | None = RANK0,
    pp: int = 1,
) -> VerifiedArtifact:
    return verify_local(
        directory,
        load_format=load_format,
        settings=settings or PluginSettings(),
        running_tp=tp,
        vllm_version=vllm_version,
        rank_glob=rank_glob,
        running_pp=pp,
    )


def edit_manifest(directory: Path, **changes: object) -> None:
    path = directory / MANIFEST
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


@pytest.fixture
def artifact(llama_tp2: Artifact, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_tp2.path, tmp_path / "a"))


def test_matching_artifact_yields_this_ranks_files_with_headers(llama_tp2: Artifact) -> None:
    verified = verify(llama_tp2.path, settings=PluginSettings(digest=llama_tp2.digest, tp=2))
    assert [f.path.name for f in verified.files] == ["model-rank-0-part-0.safetensors"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in verified.tensor_names
    assert verified.bytes == (llama_tp2.path / "model-rank-0-part-0.safetensors").stat().st_size


def test_digest_mismatch_names_both_digests(llama_tp2: Artifact) -> None:
    with pytest.raises(ArtifactError) as e:
        verify(llama_tp2.path, settings=PluginSettings(digest="feedface"))
    assert str(e.value) == (
        f"modelstage: refusing to load {llama_tp2.path}: artifact digest is {llama_tp2.digest}, "
        "expected feedface; the artifact belongs to another spec; re-stage or point at the "
        "right artifact"
    )


def test_running_tp_other_than_the_staged_one_is_refused(llama_tp2: Artifact) -> None:
    with pytest.raises(
        ArtifactError,
        match=r"staged for tensor parallel size 2, but the workload runs 4; stage it for 4",
    ):
        verify(llama_tp2.path, tp=4)


def test_running_pp_other_than_the_staged_one_is_refused_before_any_file_is_read(
    llama_tp2: Artifact,
) -> None:
    with pytest.raises(
        ArtifactError,
        match=r"staged for pipeline parallel size 1, but the workload runs 2; stage it for 2",
    ):
        verify(llama_tp2.path, pp=2, rank_glob="model-pp-0-tp-0-part-*.safetensors")


def test_a_pipelined_artifact_is_refused_by_a_vllm_naming_files_by_tp_rank_alone(
    artifact: Path,
) -> None:
    edit_manifest(artifact, pipelineParallelSize=2)
    with pytest.raises(ArtifactError, match=r"vLLM 0.31.0 names a rank's files by its tensor"):
        verify(artifact, pp=2, vllm_version="0.31.0")


def test_tp_from_the_environment_must_match_vllms(llama_tp2: Artifact) -> None:
    with pytest.raises(ArtifactError, match=r"MODELSTAGE_TP, but vLLM runs 2"):
        verify(llama_tp2.path, tp=2, settings=PluginSettings(tp=4))


def test_layout_of_another_vllm_version_is_refused_with_the_version_to_stage_for(
    artifact: Path,
) -> None:
    edit_manifest(artifact, layoutVersion="vllm-0.31/1", vllmVersion="0.31")
    with pytest.raises(ArtifactError, match=r"re-stage with --vllm-version 0\.32$"):
        verify(artifact)


def test_unknown_vllm_version_is_refused(llama_tp2: Artifact) -> None:
    with pytest.raises(ArtifactError, match=r"vLLM version '0.99.1' has no known sharded layout"):
        verify(llama_tp2.path, vllm_version="0.99.1")


def test_format_the_load_format_cannot_read_is_refused(llama_tp2: Artifact) -> None:
    with pytest.raises(
        ArtifactError, match=r"cannot be loaded with --load-format modelstage_runai_streamer"
    ):
        verify(llama_tp2.path, load_format="modelstage_runai_streamer", rank_glob=None)


def test_format_other_than_modelstage_format_is_refused(llama_tp2: Artifact) -> None:
    settings = PluginSettings(format="runai_streamer_sharded")
    with pytest.raises(ArtifactError, match=r"MODELSTAGE_FORMAT says 'runai_streamer_sharded'"):
        verify(llama_tp2.path, settings=settings)


def test_missing_manifest_means_incomplete(artifact: Path) -> None:
    (artifact / MANIFEST).unlink()
    with pytest.raises(ArtifactError, match=r"no modelstage.json: the artifact is incomplete"):
        verify(artifact)


def test_rank_file_not_in_the_manifest_is_refused_because_vllm_would_load_it(
    artifact: Path,
) -> None:
    shutil.copy(
        artifact / "model-rank-0-part-0.safetensors", artifact / "model-rank-0-part-1.safetensors"
    )
    with pytest.raises(
        ArtifactError, match=r"model-rank-0-part-1.safetensors match .* not in the manifest"
    ):
        verify(artifact)


def test_size_mismatch_and_bad_header_are_refused(artifact: Path) -> None:
    rank_file = artifact / "model-rank-0-part-0.safetensors"
    with open(rank_file, "r+b") as f:
        f.write(b"\xff" * 8)  # header length 2**64-1
    with pytest.raises(ArtifactError, match=r": chunk 0 \(bytes 0-\d+\) has BLAKE3 [0-9a-f]{64}, "):
        verify(artifact)  # the header's chunk is checked before the header is trusted
    with pytest.raises(ArtifactError, match=r"exceeds the .*-byte limit; re-stage"):
        verify(artifact, settings=PluginSettings(verify=False))
    with open(rank_file, "ab") as f:
        f.write(b"x")
    with pytest.raises(ArtifactError, match=r"bytes, the manifest says"):
        verify(artifact)


def test_the_verify_phase_leaves_content_to_the_streaming_check_or_the_pass(
    artifact: Path,
) -> None:
    """The verify phase reads headers only (the reader hashes every byte as it streams in,
    ``content_checker``); ``verify_content``, the pass before loading, names the chunk."""
    rank_file = artifact / "model-rank-1-part-0.safetensors"
    size = rank_file.stat().st_size
    verified = verify(artifact, tp=2, rank_glob="model-rank-1-part-*.safetensors")
    with open(rank_file, "r+b") as f:  # after the verify phase (which hashed the header's chunk)
        f.seek(-1, 2)
        f.write(b"\x01")
    checker = content_checker(verified)
    assert checker is not None and [w for w, _ in checker.files] == [str(rank_file)]
    with pytest.raises(ArtifactError) as e:
        verify_content(verified)
    assert str(e.value).startswith(
        f"modelstage: refusing to load {rank_file}: chunk 0 (bytes 0-{size - 1}) has BLAKE3 "
    ) and str(e.value).endswith("; the file is corrupt: re-stage it"), e.value


def test_a_tensor_in_two_part_files_is_refused(artifact: Path) -> None:
    names = [f"model-rank-0-part-{p}.safetensors" for p in (10, 2, 1)]
    src = artifact / "model-rank-0-part-0.safetensors"
    doc = json.loads((artifact / MANIFEST).read_text())
    for name in names:
        shutil.copy(src, artifact / name)
        doc["files"][name] = doc["files"][src.name]
    (artifact / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(
        ArtifactError, match=r"is in both model-rank-0-part-0.safetensors and model-rank-0-part-1"
    ):
        verify(artifact)


def test_parts_load_in_part_number_order_not_name_order() -> None:
    names = [f"model-rank-0-part-{p}.safetensors" for p in (10, 2, 1, 0)]
    ordered = sorted(names, key=_part_key(RANK0))
    assert ordered == [f"model-rank-0-part-{p}.safetensors" for p in (0, 1, 2, 10)]


def test_settings_parse_strictly() -> None:
    s = PluginSettings.from_env({"MODELSTAGE_TP": "2", "MODELSTAGE_METRICS_PORT": "9400",
                                 "MODELSTAGE_VERIFY": "0", "MODELSTAGE_READ_DEPTH": "8"})  # fmt: skip
    assert (s.tp, s.metrics_port, s.verify, s.depth) == (2, 9400, False, 8)
    assert PluginSettings.from_env({}) == PluginSettings()
    assert PluginSettings().verify, "content verification is on unless turned off"
    assert PluginSettings.from_env({"MODELSTAGE_VERIFY": ""}).verify
    assert PluginSettings.from_env({"MODELSTAGE_VERIFY": "1"}).verify
    s3 = PluginSettings.from_env({"MODELSTAGE_S3_READER": "1", "MODELSTAGE_S3_READ_CHUNK_MIB": "32",
                                  "MODELSTAGE_S3_READ_CONCURRENCY": "12"})  # fmt: skip
    assert (s3.s3_reader, s3.s3_chunk_bytes, s3.s3_depth) == (True, 32 << 20, 12)
    with pytest.raises(SpecError, match=r"MODELSTAGE_TP='two' is not an integer"):
        PluginSettings.from_env({"MODELSTAGE_TP": "two"})
    with pytest.raises(SpecError, match=r"MODELSTAGE_METRICS_PORT=70000 must be in \[1, 65535\]"):
        PluginSettings.from_env({"MODELSTAGE_METRICS_PORT": "70000"})
    with pytest.raises(SpecError, match=r"MODELSTAGE_VERIFY='off' must be 1 or 0"):
        PluginSettings.from_env({"MODELSTAGE_VERIFY": "off"})


def test_the_safetensors_loader_checks_every_file_of_the_hugging_face_layout(
    tied_root: Path, tmp_path: Path
) -> None:
    """Every rank reads every safetensors file of the Hugging Face layout: the verify phase
    names them all, and the pass before loading (vLLM's default loader moves the bytes)
    refuses a flipped bit in any of them by its chunk hash, with default settings."""
    staged = stage_artifact(tied_root, TIED, 1, "safetensors")
    artifact = Path(shutil.copytree(staged.path, tmp_path / "a"))
    settings = PluginSettings(digest=staged.digest, format="safetensors")
    verified = verify(
        artifact, tp=1, settings=settings, load_format="modelstage_safetensors", rank_glob=None
    )
    weights = sorted(p.name for p in artifact.glob("*.safetensors"))
    assert len(weights) == 2 and sorted(f.path.name for f in verified.files) == weights
    assert content_checker(verified) is not None, "the copy has chunk hashes (schema 2)"
    victim = artifact / weights[-1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's data: headers and sizes stay valid
    victim.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as e:
        verify_content(verified)
    assert str(e.value).startswith(f"modelstage: refusing to load {victim}: chunk ") and str(
        e.value
    ).endswith("; the file is corrupt: re-stage it"), e.value
    assert " has BLAKE3 " in str(e.value) and "the manifest says" in str(e.value)
    runai = stage_artifact(tied_root, TIED, 1, "runai_streamer")
    with pytest.raises(
        ArtifactError,
        match=r"'runai_streamer' cannot be loaded with --load-format "
        r"modelstage_safetensors; it loads safetensors",
    ):
        verify(runai.path, tp=1, load_format="modelstage_safetensors", rank_glob=None)
