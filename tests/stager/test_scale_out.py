"""Scale-out staging: n workers (``stage --group i/n``) + ``finalize`` == one pod, byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from modelstage.core.architectures import NON_LAYER_GROUP
from modelstage.core.errors import ArtifactError, DestinationError, SpecError
from modelstage.core.layouts import layout_for
from modelstage.core.location import verify_directory
from modelstage.core.manifest import MANIFEST, TIMING_FIELDS
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.scale_out import Group, assign_parts, finalize, part_sizes, stage_group
from modelstage.stager.shard_plan import ShardPlan, plan_shards
from modelstage.stager.stage import StageRequest, stage
from modelstage.stager.writers.rank_files import plan_parts

PART_BYTES = 400_000
"""Small parts, so that the tiny test models have several per rank."""


def _plan(llama_ckpt: Path, tp: int = 2) -> ShardPlan:
    from modelstage.stager.checkpoint import open_checkpoint
    from modelstage.stager.sources import open_source

    source = open_source(str(llama_ckpt))
    try:
        ckpt = open_checkpoint(source)
        return plan_shards(ckpt.model, ckpt.source_tensors, tp, layout_for(None))
    finally:
        source.close()


def _rank_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.glob("model-rank-*.safetensors")}


def _manifest(directory: Path) -> dict[str, object]:
    raw = json.loads((directory / MANIFEST).read_text())
    return {k: v for k, v in raw.items() if k not in TIMING_FIELDS}


# -- the pure part layout and assignment -------------------------------------------------------


def test_parts_are_cut_only_between_whole_groups_with_embeddings_and_head_together(
    llama_ckpt: Path,
) -> None:
    plan = _plan(llama_ckpt)
    parts = plan_parts(plan, max_part_bytes=1)  # every group alone
    part_of = {t.name: p for p, part in enumerate(parts) for t in part}
    by_group: dict[int, set[int]] = {}
    for target in plan.targets:
        by_group.setdefault(target.group, set()).add(part_of[target.name])
    assert all(len(p) == 1 for p in by_group.values()), by_group
    assert by_group[NON_LAYER_GROUP] == {0}
    assert "lm_head.weight" in {t.name for t in parts[0]}
    assert "model.embed_tokens.weight" in {t.name for t in parts[0]}
    assert sorted(t.name for part in parts for t in part) == sorted(t.name for t in plan.targets)


def test_a_rank_that_fits_one_part_keeps_the_plans_order(llama_ckpt: Path) -> None:
    plan = _plan(llama_ckpt)
    assert plan_parts(plan, max_part_bytes=10**12) == [list(plan.targets)]


def test_parts_pack_groups_up_to_the_size_limit(llama_ckpt: Path) -> None:
    plan = _plan(llama_ckpt)
    layer = sum(t.nbytes for t in plan.targets if t.group == 0)
    head = sum(t.nbytes for t in plan.targets if t.group == NON_LAYER_GROUP)
    parts = plan_parts(plan, max_part_bytes=head + layer)
    assert [{t.group for t in part} for part in parts] == [{NON_LAYER_GROUP, 0}, {1}]
    parts = plan_parts(plan, max_part_bytes=head + layer - 1)
    assert [{t.group for t in part} for part in parts] == [{NON_LAYER_GROUP}, {0}, {1}]


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=40),
    workers=st.integers(min_value=1, max_value=16),
)
def test_assignment_covers_every_part_once_in_contiguous_runs(
    sizes: list[int], workers: int
) -> None:
    ranges = assign_parts(sizes, workers)
    assert len(ranges) == workers
    assert [p for r in ranges for p in r] == list(range(len(sizes)))


def test_assignment_balances_bytes_across_workers() -> None:
    ranges = assign_parts([10] * 8, 4)
    assert [list(r) for r in ranges] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [len(r) for r in assign_parts([100, 1, 1, 1, 1, 100], 2)] == [3, 3]
    assert [len(r) for r in assign_parts([5, 5], 4)] == [0, 1, 0, 1]  # by middle byte


def test_group_is_parsed_from_the_cli_or_the_indexed_job_environment() -> None:
    assert Group.parse("3/4") == Group(3, 4)
    assert Group.from_env({"JOB_COMPLETION_INDEX": "2", "MODELSTAGE_WORKERS": "4"}) == Group(2, 4)
    assert Group.from_env({"JOB_COMPLETION_INDEX": "2"}) is None
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(SpecError, match="I/N"):
            Group.parse(bad)
    with pytest.raises(SpecError, match="JOB_COMPLETION_INDEX"):
        Group.from_env({"MODELSTAGE_WORKERS": "4"})


# -- workers and finalize on a local directory -------------------------------------------------


def _request(src: Path, out: Path, tp: int = 2) -> StageRequest:
    return StageRequest(source=str(src), out=str(out), tp=tp, max_part_bytes=PART_BYTES)


def _cli(*args: str) -> subprocess.Popen[str]:
    cmd = [str(Path(sys.executable).with_name("modelstage")), *args]
    env = dict(os.environ)
    return subprocess.Popen(cmd, env=env, cwd="/", text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _run_all(procs: list[subprocess.Popen[str]]) -> list[dict[str, object]]:
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def scale_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~100 MB of float32 weights in three source files, q/k/v and gate/up spread across
    them (fused tensors assembled from several files), 8 layers: 9 parts per rank at 16 MB."""
    spec = SyntheticModel(hidden_size=1024, intermediate_size=2816, num_layers=8,
                          vocab_size=8000, num_shards=3, split_fused=True)  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("scale") / "ckpt")


def test_four_worker_processes_write_the_same_artifact_as_one_pod(
    scale_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real CLI, four workers at once on one shared directory, then finalize; the
    timings land in the report (2 shared cores here: this proves correctness, not speed)."""
    part = str(16 * 1024 * 1024)
    common = ["--tp", "2", "--max-part-bytes", part]
    t0 = time.monotonic()
    (one,) = _run_all([_cli("stage", str(scale_ckpt), *common, "--out", str(tmp_path / "one"))])
    serial = time.monotonic() - t0

    out = str(tmp_path / "four")
    t0 = time.monotonic()
    groups = _run_all([_cli("stage", str(scale_ckpt), *common, "--out", out, "--group", f"{i}/4")
                       for i in range(4)])  # fmt: skip
    assert not Path(out).exists(), "workers must not publish anything"
    (final,) = _run_all([_cli("finalize", str(scale_ckpt), *common, "--out", out)])
    parallel = time.monotonic() - t0

    assert all(g["parts"] for g in groups), "9 parts: every worker has some"
    assert sum(int(str(g["files"])) for g in groups) == 2 * 9
    assert _rank_files(tmp_path / "four") == _rank_files(tmp_path / "one")
    assert len(_rank_files(tmp_path / "one")) == 2 * 9
    assert _manifest(tmp_path / "four") == _manifest(tmp_path / "one")
    verify_directory(tmp_path / "four")
    assert final["bytes"] == one["bytes"] and not final["alreadyStaged"]
    assert not list(tmp_path.glob("four.tmp-*")), "finalize removes the shared work directory"
    with capsys.disabled():
        print(f"\nscale-out: {one['bytes'] / 1e6:.0f} MB artifact, 1 pod {serial:.2f} s, "
              f"4 workers + finalize {parallel:.2f} s")  # fmt: skip


def test_worker_rerun_reuses_its_finished_parts(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    first = stage_group(_request(llama_ckpt, out), Group(0, 2))
    assert first["files"]
    work = next(tmp_path.glob("a.tmp-shared-*"))
    stamps = {p.name: p.stat().st_mtime_ns for p in work.glob("model-rank-*")}
    again = stage_group(_request(llama_ckpt, out), Group(0, 2))
    assert again["files"] == first["files"]
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("model-rank-*")} == stamps


def test_finalize_refuses_a_missing_part_and_publishes_nothing(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "a"
    stage_group(_request(llama_ckpt, out), Group(0, 2))  # worker 1 of 2 never ran
    with pytest.raises(ArtifactError, match=r"model-rank-0-part-\d+\.safetensors is missing"):
        finalize(_request(llama_ckpt, out))
    assert not out.exists()
    stage_group(_request(llama_ckpt, out), Group(1, 2))
    finalize(_request(llama_ckpt, out))
    verify_directory(out)


def test_finalize_refuses_a_corrupt_part(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    for i in range(2):
        stage_group(_request(llama_ckpt, out), Group(i, 2))
    work = next(tmp_path.glob("a.tmp-shared-*"))
    victim = work / "model-rank-1-part-1.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"rank-1-part-1\.safetensors.*corrupt"):
        finalize(_request(llama_ckpt, out))
    assert not out.exists()


def test_finalize_refuses_a_truncated_part(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    for i in range(2):
        stage_group(_request(llama_ckpt, out), Group(i, 2))
    victim = next(tmp_path.glob("a.tmp-shared-*")) / "model-rank-0-part-0.safetensors"
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ArtifactError, match=r"rank-0-part-0\.safetensors has the wrong size"):
        finalize(_request(llama_ckpt, out))


def test_finalize_without_any_worker_says_to_run_them_first(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    with pytest.raises(ArtifactError, match="no worker has written"):
        finalize(_request(llama_ckpt, tmp_path / "a"))


def test_workers_and_finalize_of_a_complete_artifact_do_nothing(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "a"
    stage(_request(llama_ckpt, out))
    assert stage_group(_request(llama_ckpt, out), Group(1, 4))["alreadyStaged"]
    assert finalize(_request(llama_ckpt, out))["alreadyStaged"]
    assert not list(tmp_path.glob("a.tmp-*"))


def test_a_one_pod_stager_and_a_worker_never_share_a_location(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    """The lock: workers share it with each other, never with a one-pod run or finalize."""
    from modelstage.stager.destinations.local import LocalDestination

    holder = LocalDestination(str(tmp_path / "a"))
    holder.begin_shared("k" * 64)
    try:
        with pytest.raises(DestinationError, match="another stager"):
            stage(_request(llama_ckpt, tmp_path / "a"))
        other = LocalDestination(str(tmp_path / "a"))
        other.begin_shared("k" * 64)  # a second worker of the run joins
        other.release()
    finally:
        holder.release()


def test_scale_out_is_refused_for_formats_with_one_writer(llama_ckpt: Path, tmp_path: Path) -> None:
    req = StageRequest(source=str(llama_ckpt), out=str(tmp_path / "a"), tp=2,
                       format="runai_streamer")  # fmt: skip
    with pytest.raises(SpecError, match="one writer"):
        stage_group(req, Group(0, 2))


def test_part_sizes_equal_the_files_written(llama_ckpt: Path, tmp_path: Path) -> None:
    plan = _plan(llama_ckpt)
    parts = plan_parts(plan, PART_BYTES)
    stage(_request(llama_ckpt, tmp_path / "a"))
    on_disk = [(tmp_path / "a" / f"model-rank-0-part-{p}.safetensors").stat().st_size
               for p in range(len(parts))]  # fmt: skip
    assert part_sizes(parts) == on_disk and len(parts) > 1
