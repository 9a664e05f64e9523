"""The ``modelstage`` command's edges as a person meets them: help, version, flags that take
sizes and digests, what an occupied ``--out`` or a mismatched finalize says, progress lines,
lock files, and ``modelstage demo`` end to end."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from modelstage.core.errors import SpecError
from modelstage.core.location import verify_directory
from modelstage.core.progress import Progress
from modelstage.stager import cli
from modelstage.stager.destinations import local
from modelstage.stager.destinations.local import LocationLock
from modelstage.stager.stage import StageRequest, stage

MODELSTAGE = str(Path(sys.executable).with_name("modelstage"))


def run(*args: str, cwd: str = "/") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELSTAGE_")}
    return subprocess.run([MODELSTAGE, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def last_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def summary(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def locks(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".lock"))


# --- help, version ------------------------------------------------------------------------------
def test_finalize_help_is_finalizes_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["finalize", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: modelstage finalize ") and "--group" in out
    assert "Check every part" in out


def test_version_prints_the_installed_package_version() -> None:
    from importlib.metadata import version

    done = run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"modelstage {version('modelstage')}"


def test_the_description_lists_the_commands_there_are(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for command in ("stage", "finalize", "verify", "prepare", "delete", "demo", "bench"):
        assert f" {command}," in out or f" {command}." in out, command
    assert "stage, verify, demo" not in out


# --- --digest, --max-part-bytes -----------------------------------------------------------------
@pytest.mark.parametrize("digest", ["xyz", "0123456789ABCDEF0123", "0123456789abcdef012"])
def test_a_stage_digest_that_is_not_20_hex_characters_is_refused(
    llama_ckpt: Path, tmp_path: Path, digest: str
) -> None:
    done = run("stage", str(llama_ckpt), "--tp", "2", "--out", str(tmp_path / "a"),
               "--digest", digest)  # fmt: skip
    assert last_error(done) == (
        f"error: --digest {digest!r}: expected 20 lower-case hex characters (as `modelstage "
        "plan` or the operator computes it)"
    )
    assert not (tmp_path / "a").exists()


def test_stage_help_says_the_digest_is_used_not_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["stage", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "use this artifact digest (20 hex characters) instead of computing one" in help_text
    assert "recorded, not checked" in help_text


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5368709120", 5368709120), ("50M", 50_000_000), ("512Mi", 512 * 2**20), ("1G", 10**9),
     ("1Gi", 2**30), ("1.5Gi", 3 * 2**29), ("64k", 64_000), ("2MiB", 2 * 2**20)],
)  # fmt: skip
def test_max_part_bytes_takes_kubernetes_style_sizes(text: str, expected: int) -> None:
    assert cli.parse_bytes(text, "--max-part-bytes") == expected


@pytest.mark.parametrize("text", ["5X", "0", "1.5", "-3M", "M", "0.1"])
def test_max_part_bytes_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(SpecError, match="--max-part-bytes"):
        cli.parse_bytes(text, "--max-part-bytes")


def test_max_part_bytes_with_a_suffix_cuts_parts(llama_ckpt: Path, tmp_path: Path) -> None:
    done = summary(run("stage", str(llama_ckpt), "--tp", "2", "--out", str(tmp_path / "a"),
                       "--max-part-bytes", "1Mi"))  # fmt: skip
    parts = sorted(p.name for p in (tmp_path / "a").glob("model-rank-0-part-*"))
    assert len(parts) > 1 and done["files"] == 2 * len(parts) + 5  # + config, tokenizer...


@pytest.mark.parametrize("text", ["65Mi", "67108865", "1Gi"])
def test_chunk_bytes_above_64_mib_is_one_line_naming_the_flag_and_the_cap(
    llama_ckpt: Path, tmp_path: Path, text: str
) -> None:
    done = run("stage", str(llama_ckpt), "--tp", "2", "--out", str(tmp_path / "a"),
               "--chunk-bytes", text)  # fmt: skip
    value = cli.parse_bytes(text, "--chunk-bytes")
    assert last_error(done) == (
        f"error: --chunk-bytes {text!r}: {value} bytes is more than 67108864 (64Mi), the "
        "largest hash chunk a reader holds in memory; use 64Mi or less"
    )
    assert "Traceback" not in done.stderr and not (tmp_path / "a").exists()


def test_chunk_bytes_at_the_cap_or_below_sets_the_manifests_chunk_size(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    summary(run("stage", str(llama_ckpt), "--tp", "2", "--out", str(tmp_path / "a"),
                "--chunk-bytes", "1Mi"))  # fmt: skip
    files = json.loads((tmp_path / "a" / "modelstage.json").read_text())["files"]
    assert {f["chunkBytes"] for f in files.values()} == {1 << 20}
    assert cli.parse_chunk_bytes("64Mi") == 64 << 20 and cli.parse_chunk_bytes(None) is None


def test_a_stage_request_over_the_chunk_cap_is_a_spec_error(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    with pytest.raises(SpecError, match=r"--chunk-bytes\) is 67108865: it must be from 1 to "):
        stage(StageRequest(source=str(llama_ckpt), out=str(tmp_path / "a"), tp=2,
                           chunk_bytes=(64 << 20) + 1))  # fmt: skip


# --- an occupied --out --------------------------------------------------------------------------
def test_an_occupied_out_says_what_is_there_and_what_this_run_would_write(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "llama"
    first = stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2))
    done = run("stage", str(llama_ckpt), "--tp", "1", "--out", str(out))
    line = last_error(done)
    source = f"file://{llama_ckpt}"
    identity = first["sourceIdentity"]
    assert line.startswith(
        f"error: {out} already holds artifact {first['digest']} (sharded_state, TP 2, dtype "
        f"auto, from {source}, source identity {identity}, staged "
    )
    assert "; this run would write artifact " in line
    assert (f"(sharded_state, TP 1, dtype auto, from {source}, source identity {identity}); "
            "they differ in TP.") in line  # fmt: skip
    assert line.endswith(f"(`modelstage delete --artifact {out}`)")
    assert "re-stage" not in line
    verify_directory(out, tp=2)


# --- scale-out: finalize with the workers' arguments --------------------------------------------
def test_finalize_accepts_the_workers_group_flag_and_ignores_it(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    out = str(tmp_path / "a")
    common = ["--tp", "2", "--out", out, "--max-part-bytes", "1Mi"]
    for i in range(2):
        summary(run("stage", str(llama_ckpt), *common, "--group", f"{i}/2"))
    done = run("finalize", str(llama_ckpt), *common, "--group", "1/2")
    assert summary(done)["alreadyStaged"] is False
    assert "finalize: ignoring --group 1/2" in done.stderr
    verify_directory(Path(out), tp=2)


def test_a_worker_without_parts_says_so(llama_ckpt: Path, tmp_path: Path) -> None:
    """The small checkpoint is one part per rank at the default size; it goes to the worker
    whose share holds its middle byte, worker 1 of 2: worker 0 has none."""
    done = run("stage", str(llama_ckpt), "--tp", "2", "--out", str(tmp_path / "a"),
               "--group", "0/2")  # fmt: skip
    assert summary(done)["parts"] == []
    assert "no parts to stage (group 0/2)" in done.stderr
    assert "0..-1" not in done.stderr


def test_finalize_with_another_part_size_than_the_workers_names_it(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    out = str(tmp_path / "a")
    for i in range(2):
        summary(run("stage", str(llama_ckpt), "--tp", "2", "--out", out,
                    "--max-part-bytes", "1Mi", "--group", f"{i}/2"))  # fmt: skip
    line = last_error(run("finalize", str(llama_ckpt), "--tp", "2", "--out", out))
    assert f"the workers' parts in {out}.tmp-shared-" in line
    assert "maxPartBytes 1048576 (this finalize: 5368709120)" in line
    assert line.endswith("run finalize with the workers' arguments (--max-part-bytes 1048576)")
    assert "no worker has written" not in line
    summary(run("finalize", str(llama_ckpt), "--tp", "2", "--out", out, "--max-part-bytes", "1Mi"))


# --- progress lines ------------------------------------------------------------------------------
def test_progress_lines_give_bytes_of_the_total_rate_and_eta() -> None:
    stream = io.StringIO()
    progress = Progress(4 * 2**30, 10, label="staging", stream=stream, items="files")
    progress.start = 100.0
    progress.advance(2**30)
    progress.tensor_done()
    assert progress.line(now=110.0) == (
        "staging: 1.0 GiB / 4.0 GiB (25%), 1/10 files, 102.4 MiB/s, ETA 30s"
    )
    progress.add_total(2**30, items=2)
    assert progress.line(now=110.0).endswith("1/12 files, 102.4 MiB/s, ETA 40s")
    progress.advance(4 * 2**30)
    assert progress.line(now=200.0) == (
        "staging: 5.0 GiB / 5.0 GiB (100%), 1/12 files, 51.2 MiB/s, 1m40s"
    )
    fresh = Progress(2**30, 1, label="x", stream=stream)
    assert fresh.line(now=fresh.start + 1).endswith("0/1 tensors, 0 B/s, ETA unknown")


def test_runai_streamer_progress_counts_files(llama_ckpt: Path, tmp_path: Path) -> None:
    stream = io.StringIO()
    stage(StageRequest(source=str(llama_ckpt), out=str(tmp_path / "a"), tp=2,
                       format="runai_streamer"), progress_stream=stream)  # fmt: skip
    final = stream.getvalue().strip().splitlines()[-1]
    assert "3/3 files" in final and "tensors" not in final


def test_verify_reports_its_hashing(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    staged = stage(StageRequest(source=str(llama_ckpt), out=str(out), tp=2))
    done = run("verify", str(out))
    summary(done)
    lines = [line for line in done.stderr.splitlines() if line.startswith(f"hashing {out}:")]
    assert f"(100%), {staged['files']}/{staged['files']} files, " in lines[-1]
    sizes_only = run("verify", str(out), "--sizes-only")
    assert "hashing" not in sizes_only.stderr


def test_finalize_reports_the_parts_it_checks(llama_ckpt: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "a")
    common = ["--tp", "2", "--out", out, "--max-part-bytes", "1Mi"]
    summary(run("stage", str(llama_ckpt), *common, "--group", "0/1"))
    done = run("finalize", str(llama_ckpt), *common)
    summary(done)
    parts = len(list(Path(out).glob("model-rank-*")))
    line = [x for x in done.stderr.splitlines() if x.startswith(f"checking parts of {out}")][-1]
    assert f"(100%), {parts}/{parts} parts" in line


# --- lock files -----------------------------------------------------------------------------------
def test_no_lock_file_stays_beside_artifacts(llama_ckpt: Path, tmp_path: Path) -> None:
    stage(StageRequest(source=str(llama_ckpt), out=str(tmp_path / "one"), tp=2))
    common = ["--tp", "2", "--out", str(tmp_path / "many"), "--max-part-bytes", "1Mi"]
    for i in range(2):
        summary(run("stage", str(llama_ckpt), *common, "--group", f"{i}/2"))
    assert locks(tmp_path) == [], "workers leave no lock behind either"
    summary(run("finalize", str(llama_ckpt), *common))
    summary(run("delete", "--artifact", str(tmp_path / "one")))
    assert locks(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many"]


def test_a_held_lock_keeps_others_out_and_its_last_holder_removes_it(tmp_path: Path) -> None:
    out = tmp_path / "art"
    a, b, c = LocationLock(out), LocationLock(out), LocationLock(out)
    assert a.acquire(exclusive=False) and b.acquire(exclusive=False)
    assert not c.acquire(exclusive=True), "workers hold it: finalize must wait"
    a.release()
    assert locks(tmp_path) == [".art.lock"], "a worker is still there"
    assert not c.acquire(exclusive=True)
    b.release()
    assert locks(tmp_path) == []
    assert c.acquire(exclusive=True)
    assert not a.acquire(exclusive=False) and not b.acquire(exclusive=True)
    c.release()
    assert locks(tmp_path) == []


def test_a_taker_that_locked_a_file_just_removed_starts_over_on_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the removal opens: B opens the lock file, A (the last holder) removes it, B
    locks the removed file. B must notice and lock the file now at the path."""
    out = tmp_path / "art"
    real_open = os.open
    calls: list[str] = []

    def open_then_lose_the_race(path: str, flags: int, mode: int = 0o777) -> int:
        fd = real_open(path, flags, mode)
        calls.append(str(path))
        if len(calls) == 1:
            os.unlink(path)  # the last holder removes it right after this open
        return fd

    monkeypatch.setattr(local.os, "open", open_then_lose_the_race)
    lock = LocationLock(out)
    assert lock.acquire(exclusive=True)
    assert len(calls) == 2, "it opened the file again"
    assert os.path.samestat(os.fstat(lock.fd), os.stat(lock.path))
    monkeypatch.undo()
    other = LocationLock(out)
    assert not other.acquire(exclusive=True), "the lock at the path is really held"
    lock.release()
    assert locks(tmp_path) == []


# --- modelstage demo -------------------------------------------------------------------------------
def test_demo_generates_stages_verifies_and_summarises(tmp_path: Path) -> None:
    done = run("demo", "--workdir", str(tmp_path))
    result = summary(done)
    assert result["verified"] is True and result["alreadyStaged"] is False
    assert result["tensorParallelSize"] == 2 and result["format"] == "sharded_state"
    manifest = verify_directory(tmp_path / "artifact", tp=2, hash_content=True)
    assert manifest.digest == result["digest"] and manifest.bytes == result["bytes"]
    assert result["files"] == len(manifest.files)
    assert (tmp_path / "checkpoint" / "config.json").exists()
    err = done.stderr.splitlines()
    assert err[0] == f"demo: generated a Llama-shaped checkpoint in {tmp_path / 'checkpoint'}"
    assert err[-1].startswith("demo: staged ") and err[-1].endswith(f"verified {tmp_path / 'artifact'}")
    assert locks(tmp_path) == []


def test_demo_run_again_says_the_artifact_was_already_there(tmp_path: Path) -> None:
    summary(run("demo", "--workdir", str(tmp_path)))
    again = run("demo", "--workdir", str(tmp_path))
    assert summary(again)["alreadyStaged"] is True
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith(f"demo: {tmp_path / 'artifact'} already holds this artifact (")
    assert "/s)" not in again.stderr, "no rate for work not done"


def test_demo_with_a_tp_the_model_cannot_split_fails_in_one_line(tmp_path: Path) -> None:
    line = last_error(run("demo", "--workdir", str(tmp_path), "--tp", "3"))
    assert line.startswith("error: ") and "does not divide the 8 attention heads" in line
    assert not (tmp_path / "artifact").exists()



def test_setup_run_again_on_a_current_checkout_prints_one_line() -> None:
    """``make demo`` runs ``scripts/setup`` first; on a checkout whose editable install is
    current it must not reinstall (setuptools' warnings filled ~40 lines)."""
    root = Path(__file__).resolve().parents[2]
    venv = os.path.realpath(sys.prefix)
    env = {**os.environ, "MODELSTAGE_VENV": sys.prefix}
    for _ in range(2):  # the first brings the install up to date, if it was not
        done = subprocess.run([str(root / "scripts" / "setup")], cwd=root, env=env,
                              capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert done.stderr == f"setup: ready ({venv}, linked as .venv)\n"
    assert os.path.realpath(root / ".venv") == venv
