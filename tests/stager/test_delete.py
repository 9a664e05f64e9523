"""``modelstage delete``: the clean-up Job's command; manifest first, idempotent, and only
ever an artifact-shaped location."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from modelstage.stager import cli
from modelstage.stager.delete import delete_artifact
from modelstage.stager.errors import ArtifactError, SpecError
from modelstage.stager.manifest import MANIFEST
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
    with pytest.raises(SpecError, match="not an artifact location"):
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
