"""``modelstage bench`` runs end to end on a tiny checkpoint: it measures, it does not judge.

Speed is never asserted (the machine may be slow); what is checked is that every section is
measured, written to JSON and drawn, and that nothing is left behind, on disk or in S3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from modelstage.devtools import bench
from modelstage.devtools.synthetic import SyntheticModel
from modelstage.stager import cli
from support.s3_server import S3Server


def test_bench_measures_every_section_and_cleans_up(
    tmp_path: Path, s3: S3Server, bucket: str
) -> None:
    work, out = tmp_path / "work", tmp_path / "results"
    code = cli.main([
        "bench", "--size-gib", "0.03", "--tp", "1", "2", "--load-tp", "2", "--repeats", "1",
        "--rss-gib", "0.02", "0.04", "--moe-rss-gib", "--warm", "--workdir", str(work),
        "--out", str(out),
        "--s3", f"s3://{bucket}/bench", "--s3-endpoint", s3.endpoint, "--s3-path-style",
        "--s3-credentials-file", str(s3.credentials_file),
    ])  # fmt: skip
    assert code == 0
    result = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 0
    sections = result["sections"]
    names = {title: [m["name"] for m in rows] for title, rows in sections.items()}
    staging = next(t for t in names if t.startswith("staging vs cp"))
    assert names[staging] == ["cp + sync", "stage tp=1", "stage tp=2"]
    loads = [t for t in names if t.startswith("loading rank 0 of TP=2, page cache")]
    assert loads and all(names[t] == [
        "load rank 0: raw sequential read", "load rank 0: vLLM stock path",
        "load rank 0: modelstage reader, unverified", "load rank 0: modelstage reader, verified",
    ] for t in loads)  # fmt: skip
    verify = [t for t in names if t.startswith("verify TP=2 artifact, page cache")]
    assert verify and all(
        names[t] == ["raw sequential read, every file", "modelstage verify"] for t in verify
    )
    from_s3 = next(t for t in names if "from S3" in t)
    assert names[from_s3] == ["8-way ranged GET", "Run:ai streamer (vLLM's path)",
                              "modelstage S3 reader, unverified",
                              "modelstage S3 reader, verified (plugin)"]  # fmt: skip
    assert any("multipart PUT" in t for t in names)
    for rows in sections.values():
        for m in rows:
            assert m["seconds"] and all(s > 0 for s in m["seconds"]), m
    rss = [m["peak_rss"] for m in sections["peak RSS"]]
    assert len(rss) == 2 and all(0 < r < 2**30 for r in rss)
    left = [p.name for p in work.iterdir() if not p.name.endswith(".lock")]  # stagers' locks
    assert not left  # source, outputs and copies removed
    listed = s3.client().list_objects_v2(Bucket=bucket)
    assert listed.get("KeyCount", 0) == 0  # the S3 runs deleted what they wrote


def test_bench_moe_only_measures_peak_rss_per_format_and_size_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--moe-only``: the Mixtral-shaped section alone (its real shapes need 1 GiB a
    layer; here a tiny Mixtral whose experts grow with the size asked for)."""

    def tiny(size: int) -> SyntheticModel:
        return SyntheticModel(architecture="MixtralForCausalLM", dtype="bfloat16",
                              intermediate_size=256 * max(1, size // 2**20), num_shards=2)  # fmt: skip

    monkeypatch.setattr(bench, "mixtral_scaled", tiny)
    work, out = tmp_path / "work", tmp_path / "results"
    code = cli.main(["bench", "--moe-only", "--moe-rss-gib", "0.001", "0.002", "--load-tp", "2",
                     "--workdir", str(work), "--out", str(out)])  # fmt: skip
    assert code == 0
    sections = json.loads((out / "bench.json").read_text())["sections"]
    assert list(sections) == [bench.MOE_RSS_SECTION]
    rows = sections[bench.MOE_RSS_SECTION]
    assert [m["name"].split(",")[0] for m in rows] == [
        "MoE sharded_state",
        "MoE tensorizer",
        "MoE sharded_state",
        "MoE tensorizer",
    ]
    assert rows[0]["nbytes"] < rows[2]["nbytes"]
    assert all(0 < m["peak_rss"] < 2**30 and m["seconds"] for m in rows)
    assert (out / "bench.png").stat().st_size > 0
    assert not [p.name for p in work.iterdir() if not p.name.endswith(".lock")]


def test_bench_node_cache_sections_measure_the_node_copy_and_cp_and_clean_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy row times whatever ``node-copy``'s function is (here a stand-in that records
    its call, so the section is checked with or without the agent installed)."""
    calls: list[tuple[str, str, Path]] = []

    def copy(artifact: str, *, digest: str, root: Path) -> None:
        calls.append((artifact, digest, root))
        shutil.copytree(artifact, root / digest)

    monkeypatch.setattr(bench, "_node_copy_function", lambda: copy)
    work, out = tmp_path / "work", tmp_path / "results"
    code = cli.main(["bench", "--size-gib", "0.03", "--load-tp", "2", "--repeats", "2",
                     "--node-cache-only", "--warm", "--workdir", str(work), "--out", str(out)])  # fmt: skip
    assert code == 0
    sections = json.loads((out / "bench.json").read_text())["sections"]
    names = {title: [m["name"] for m in rows] for title, rows in sections.items()}
    assert names == {
        "node cache: loading rank 0 of TP=2": [
            "load rank 0: raw read of the PVC path, warm",
            "load rank 0: plugin from node copy, warm",
        ],
        "node cache: copying the TP=2 artifact to a node": [
            "copy to node: cp -r + sync",
            "copy to node: modelstage node-copy",
        ],
    }
    for rows in sections.values():
        for m in rows:
            assert len(m["seconds"]) == 2 and all(s > 0 for s in m["seconds"]), m
    assert len(calls) == 2 and calls[0][2] == work / "node"
    assert not [p.name for p in work.iterdir() if not p.name.endswith(".lock")]


def test_without_the_agent_the_copy_section_has_the_cp_row_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "NODE_COPY_MODULE", "modelstage.no_such_module")
    assert bench._node_copy_function() is None
    artifact = tmp_path / "a"
    artifact.mkdir()
    (artifact / "f").write_bytes(b"x" * 100)
    rows = bench.bench_node_copy(artifact, "d" * 20, tmp_path / "node", 1)
    assert [m.name for m in rows] == ["copy to node: cp -r + sync"] and rows[0].seconds
