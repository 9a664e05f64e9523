"""Helpers for the serving-side tests: staged artifacts, a pod-like environment, locked vLLM runs.

vLLM runs are serialised machine-wide with ``flock`` on ``VLLM_LOCK``: this machine's two
cores are shared with other test runs that start vLLM too, and two vLLM instances at once
would each time out.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.stager.stage import StageRequest, stage

from support.vllm_lock import vllm_lock

TIED = SyntheticModel(tie_word_embeddings=True, num_shards=2, split_fused=True)
"""Tied embeddings: the artifact holds ``lm_head`` only (vLLM's sharded layout)."""
LLAMA_TP2 = SyntheticModel(num_shards=2, split_fused=True, seed=3)

TESTS = Path(__file__).resolve().parents[1]
RUN_VLLM = TESTS / "vllm" / "run_vllm.py"
POD_RUNNER = TESTS / "serving" / "pod_runner.py"
VLLM_TIMEOUT = 300
PROMPTS = [[1, 7, 42, 99, 311, 512, 900], [2, 64, 128, 5]]


@dataclass(frozen=True)
class Artifact:
    path: Path
    digest: str
    tp: int
    format: str = "sharded_state"


def run_locked(
    cmd: list[str], *, env: Mapping[str, str], cwd: Path, timeout: int = VLLM_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    with vllm_lock():
        return subprocess.run(
            cmd, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout
        )


def base_env() -> dict[str, str]:
    """The caller's environment minus anything that would leak modelstage settings in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELSTAGE_")}
    env.pop("PYTHONPATH", None)
    return env


def stage_artifact(
    root: Path, spec: SyntheticModel, tp: int, format: str = "sharded_state"
) -> Artifact:
    """Stage ``spec`` (generated once per ``root``) as ``format`` at ``tp``."""
    src = root / "ckpt"
    if not src.exists():
        write_checkpoint(spec, src)
    out = root / f"{format}-tp{tp}"
    summary = stage(StageRequest(source=str(src), out=str(out), tp=tp, format=format))
    return Artifact(out, summary["digest"], tp, format)


def pod_env(plugin_dir: Path, site: Path, modelstage: Mapping[str, str]) -> dict[str, str]:
    env = base_env()
    env.pop("VLLM_PLUGINS", None)  # unset: vLLM loads every plugin it finds, the pod's too
    env["PYTHONPATH"] = f"{plugin_dir}{os.pathsep}{site}"
    env.update({f"MODELSTAGE_{k.upper()}": v for k, v in modelstage.items()})
    return env


def prepare_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``modelstage prepare`` exactly as the initContainer runs it."""
    cmd = [sys.executable, "-m", "modelstage.stager.cli", "prepare", *args]
    return subprocess.run(cmd, env=base_env(), cwd=cwd, capture_output=True, text=True)


def last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    out_lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and out_lines:
        return out_lines[-1]
    return lines[-1] if lines else ""


def free_ports(count: int) -> int:
    """A base port such that ``base .. base + count - 1`` are free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base: int = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def stock_run(artifact: Artifact, tmp: Path) -> dict[str, Any]:
    """vLLM's own ``sharded_state`` loader on the artifact: the reference. Stock vLLM:
    ``VLLM_PLUGINS=""`` keeps the installed modelstage plugin from registering."""
    out = tmp / "stock.json"
    proc = run_locked(
        [sys.executable, str(RUN_VLLM), "--model", str(artifact.path), "--tp", str(artifact.tp),
         "--load-format", "sharded_state", "--prompts", json.dumps(PROMPTS), "--out", str(out)],
        env={**base_env(), "VLLM_PLUGINS": ""}, cwd=tmp,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["plugin_load_formats"] == [], "the stock reference ran with the plugin"
    return result


def pod_run(
    artifact: Artifact, plugin_dir: Path, site: Path, tmp: Path, *, tp: int | None = None,
    metrics_port: int | None = None, settings: Mapping[str, str],
    load_format: str = "modelstage_sharded_state",
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:  # fmt: skip
    """The plugin's format in a pod-like interpreter; returns the process and its JSON.
    ``settings`` become ``MODELSTAGE_<KEY>`` variables."""
    modelstage = dict(settings)
    out = tmp / "pod.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-S", str(POD_RUNNER), "--runner", str(RUN_VLLM),
           "--model", str(artifact.path), "--tp", str(tp or artifact.tp),
           "--load-format", load_format, "--prompts", json.dumps(PROMPTS),
           "--out", str(out)]  # fmt: skip
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
        modelstage["metrics_port"] = str(metrics_port)
        modelstage["metrics_addr"] = "127.0.0.1"
    proc = run_locked(cmd, env=pod_env(plugin_dir, site, modelstage), cwd=tmp)
    return proc, (json.loads(out.read_text()) if out.exists() else None)
