"""``modelstage capture-engine-cache``: run the serving vLLM once, keep its compile caches.

The shell around ``core/engine_cache.py``: a child process (``engine_run.py``, a fresh
interpreter) starts vLLM on the staged artifact with the workload's engine arguments and cache
roots in a new temporary folder beside ``--out``, generates one token and exits; what it wrote
under the roots (``ROOTS``: vLLM's, inductor's, Triton's) is hashed in chunks and fsynced, the
manifest written last, and the folder renamed to ``--out``: a crash leaves a ``.tmp-`` folder,
never something that looks complete. A Job runs it as it runs ``stage``: on success the last
line is a one-line JSON summary (the key and the serving configuration ``prepare`` is to be
given), on failure ``error: ...``.

On the CPU build the capture sets ``VLLM_USE_AOT_COMPILE=0`` unless told otherwise: vLLM's
default AOT mode writes a cache that a CPU start does not load back (it compiles again), while
torch's own caches under ``TORCHINDUCTOR_CACHE_DIR`` are found from any folder. The variable
is part of the key, so the serving container must set it too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

from modelstage.core.durable import fsync_dir, fsync_file, write_atomic
from modelstage.core.engine_cache import ENGINE_MANIFEST, ROOTS, EngineCacheManifest, check_path
from modelstage.core.engine_key import (
    EngineArgs,
    HardwareClass,
    ServingConfig,
    compile_environment,
    key_factors,
    key_of,
)
from modelstage.core.errors import ArtifactError, DestinationError
from modelstage.core.integrity import hash_local_files
from modelstage.core.manifest import FileEntry, read_manifest

from .engine_hardware import this_node

DEFAULT_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
RUNTIME_SUFFIXES = (".lock",)
"""Files the caches hold only while a process runs (inductor's ``locks/``): not kept."""
LOG_TAIL_LINES = 15
CONFIG_FACTORS = ("vllmVersion", "torchVersion", "modelPath", "engineArgs", "environment")
"""The factors of a cache's key that make up its serving configuration (``ServingConfig``):
what a rerun that finds the cache complete reports, as the first run did."""


def capture(
    artifact: Path,
    out: Path,
    args: EngineArgs,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 1800.0,
    hardware: HardwareClass | None = None,
) -> dict[str, Any]:
    """Capture once; an ``out`` that already holds a complete cache is left as it is."""
    weights = read_manifest(artifact)
    if weights is None:
        raise ArtifactError(f"{artifact}: no modelstage.json: stage the artifact first")
    existing = _existing(out)
    if existing is not None:
        factors = existing.factors
        recorded = {k: factors.get(k) for k in CONFIG_FACTORS}
        return {"engineCache": str(out), "key": existing.key, "alreadyCaptured": True,
                "files": len(existing.files), "bytes": existing.bytes, "config": recorded,
                "hardware": factors.get("hardware")}  # fmt: skip
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        child_env = {**os.environ, **DEFAULT_ENV, **(env or {})}
        child_env.update({var: str(work / name) for name, var in ROOTS.items()})
        ran = run_engine(artifact, args, child_env, timeout, log=work.parent / f"{work.name}.log")
        config = ServingConfig(ran["vllmVersion"], ran["torchVersion"], str(artifact), args,
                               compile_environment(child_env))  # fmt: skip
        factors = key_factors(weights.digest, config, hardware or this_node())
        manifest = write_engine_cache(
            work, factors, time.monotonic() - started, ran["seconds"]["compile"]
        )
        _publish(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        (work.parent / f"{work.name}.log").unlink(missing_ok=True)
    return {
        "engineCache": str(out), "key": manifest.key, "files": len(manifest.files),
        "bytes": manifest.bytes, "compileSeconds": manifest.compileSeconds,
        "captureSeconds": manifest.captureSeconds, "tokenIds": ran["tokenIds"],
        "config": config.to_doc(), "hardware": factors["hardware"],
    }  # fmt: skip


def _existing(out: Path) -> EngineCacheManifest | None:
    try:
        raw = (out / ENGINE_MANIFEST).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DestinationError(f"{out / ENGINE_MANIFEST}: cannot read: {e.strerror}") from None
    return EngineCacheManifest.from_json(raw, str(out / ENGINE_MANIFEST))


def run_engine(
    model: Path, args: EngineArgs, env: dict[str, str], timeout: float, *, log: Path
) -> dict[str, Any]:
    """Start vLLM once in a child (``engine_run.py``); its JSON line, or the reason it failed
    with the last lines of its log."""
    argv = [sys.executable, "-m", "modelstage.stager.engine_run", "--model", str(model),
            "--engine-args", json.dumps(args.to_doc())]  # fmt: skip
    with open(log, "w") as err:
        try:
            done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=timeout, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise ArtifactError(f"{model}: vLLM did not start within {timeout:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-LOG_TAIL_LINES:])
        raise ArtifactError(f"{model}: vLLM failed (exit {done.returncode}): {tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def write_engine_cache(
    work: Path, factors: dict[str, Any], seconds: float, compile_seconds: float
) -> EngineCacheManifest:
    """Hash and fsync every file the start wrote, then the manifest, last."""
    paths = _cache_files(work)
    digests = hash_local_files([work / p for p in paths])
    for p in paths:
        fsync_file(work / p)
    for directory in sorted({(work / p).parent for p in paths} | {work}, reverse=True):
        fsync_dir(directory)
    files = {p: FileEntry.of(d) for p, d in zip(paths, digests, strict=True)}
    manifest = EngineCacheManifest(
        key=key_of(factors), factors=factors, files=files,
        bytes=sum(d.size for d in digests), modelstageVersion=_version(),
        createdAt=datetime.now(UTC).isoformat(timespec="seconds"),
        captureSeconds=round(seconds, 3), compileSeconds=float(compile_seconds),
    )  # fmt: skip
    write_atomic(work / ENGINE_MANIFEST, manifest.to_json().encode(), 0o644)
    return manifest


def _cache_files(work: Path) -> list[str]:
    """Every regular file under the roots, as a checked relative path; a link or a special
    file is refused (nothing the cache holds may point elsewhere)."""
    found: list[str] = []
    for name in ROOTS:
        root = work / name
        for path in sorted(root.rglob("*")) if root.is_dir() else ():
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise ArtifactError(f"{path}: not a regular file; an engine cache holds files only")
            if path.is_file() and not path.name.endswith(RUNTIME_SUFFIXES):
                rel = path.relative_to(work).as_posix()
                check_path(rel)
                found.append(rel)
    return found


def _publish(work: Path, out: Path) -> None:
    """Rename the finished folder to ``out``; an ``out`` without a manifest is a leftover."""
    if out.exists():
        shutil.rmtree(out)
    work.rename(out)
    fsync_dir(out.parent)


def _version() -> str:
    try:
        return dist_version("modelstage")
    except PackageNotFoundError:
        return "0+unknown"
