"""``modelstage delete``: the clean-up Job's command; manifest first, idempotent, and only
ever an artifact: a location named by its digest, or a folder holding a manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from modelstage.core.engine_cache import ENGINE_MANIFEST
from modelstage.core.errors import ArtifactError, SpecError
from modelstage.core.manifest import MANIFEST
from modelstage.stager import cli
from modelstage.stager.delete import delete_artifact
from modelstage.stager.stage import StageRequest, stage

DIGEST = "0123456789abcdef0123"


def _staged(llama_ckpt: Path, root: Path) -> Path:
    out = root / "ns" / DIGEST
    stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2, digest=DIGEST))
    return out


def test_delete_removes_the_artifact_and_leftover_work_directories(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    out = _staged(llama_ckpt, tmp_path)
    (tmp_path / "ns" / f"{DIGEST}.tmp-shared-abc").mkdir()
    sibling = _staged(llama_ckpt, tmp_path / "other")
    result = delete_artifact(str(out), digest=DIGEST)
    assert result["removed"] >= 1 and not out.exists()
    assert sorted(p.name for p in (tmp_path / "ns").iterdir()) == []
    assert (sibling / MANIFEST).exists(), "another location is untouched"


def test_a_killed_delete_never_leaves_a_complete_looking_artifact_and_a_rerun_finishes(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    """The state after the first step: the manifest gone, the files still there."""
    out = _staged(llama_ckpt, tmp_path)
    (out / MANIFEST).unlink()
    delete_artifact(str(out))
    assert not out.exists() and not list((tmp_path / "ns").iterdir())


def test_deleting_what_is_already_gone_succeeds(tmp_path: Path) -> None:
    assert delete_artifact(str(tmp_path / "ns" / DIGEST))["removed"] == 0


def test_only_artifact_shaped_locations_are_deleted(llama_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"not an artifact \(it holds no modelstage.json"):
        delete_artifact(str(tmp_path))
    out = _staged(llama_ckpt, tmp_path)
    with pytest.raises(SpecError, match="not ffff"):
        delete_artifact(str(out), digest="ffff")
    other = tmp_path / "ns" / ("f" * 20)
    out.rename(other)
    with pytest.raises(ArtifactError, match=f"says artifact {DIGEST}"):
        delete_artifact(str(other))
    assert (other / MANIFEST).exists()


def test_cli_delete_prints_one_line_summary(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _staged(llama_ckpt, tmp_path)
    assert cli.main(["delete", "--artifact", str(out), "--digest", DIGEST]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["digest"] == DIGEST
    assert not out.exists()


def test_a_folder_named_as_the_readme_shows_is_deleted_when_its_manifest_matches(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stage --out /models/llama-tp2`` makes an artifact whose folder is not named by its
    digest: its manifest says which artifact it is."""
    out = tmp_path / "models" / "llama-tp2"
    summary = stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2))
    with pytest.raises(SpecError, match=f"its manifest says artifact {summary['digest']}, not f"):
        delete_artifact(str(out), digest="f" * 20)
    assert (out / MANIFEST).exists()
    assert cli.main(["delete", "--artifact", str(out), "--digest", summary["digest"]]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["digest"] == summary["digest"] and result["removed"] > 1
    assert list((tmp_path / "models").iterdir()) == [], "no artifact, lock or leftovers"
    assert delete_artifact(str(out))["removed"] == 0, "gone already: nothing to do"


def test_a_named_folder_without_a_manifest_is_refused_and_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "llama-tp2"
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"not ours")
    with pytest.raises(SpecError, match="remove such a folder or prefix by hand"):
        delete_artifact(str(folder))
    assert (folder / "weights.bin").exists()


def test_an_artifacts_engine_caches_go_with_it_and_no_other(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    """The engine caches beside the artifact (``<digest>.engine-<key>``, a capture's leftover
    included) are deleted with it; another artifact's stay."""
    out = _staged(llama_ckpt, tmp_path)
    ns = tmp_path / "ns"
    for name in (f"{DIGEST}.engine-{'a' * 20}", f"{DIGEST}.engine-{'b' * 20}.tmp-x1"):
        (ns / name / "inductor").mkdir(parents=True)
        (ns / name / "inductor" / "k.so").write_bytes(b"\0" * 10)
    (ns / f"{DIGEST}.engine-{'a' * 20}" / ENGINE_MANIFEST).write_text("{}")
    other = ns / f"{'f' * 20}.engine-{'a' * 20}"
    other.mkdir()
    delete_artifact(str(out), digest=DIGEST)
    assert sorted(p.name for p in ns.iterdir()) == [other.name]
