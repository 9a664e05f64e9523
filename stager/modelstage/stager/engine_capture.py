"""``modelstage capture-engine-cache``: run the serving vLLM once, keep its compile caches.

The shell around ``core/engine_cache.py``: a child process (``engine_run.py``, a fresh
interpreter) starts vLLM on the staged artifact (a folder, or an ``s3://`` prefix vLLM streams
from) with the workload's engine arguments and cache roots in a new temporary folder, generates
one token and exits; what it wrote under the roots (``ROOTS``: vLLM's, inductor's, Triton's) is
hashed in chunks and fsynced, the manifest written last. Then it is published at ``--out``: a
folder beside the artifact's is renamed (a crash leaves a ``.tmp-`` folder), or the files are
uploaded under an S3 prefix and the manifest last; either way, nothing looks complete before
its manifest is there. A Job runs it as it runs ``stage``: on success the last
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
from modelstage.core.formats import S3
from modelstage.core.integrity import hash_local_files
from modelstage.core.location import S3Artifact, open_artifact, parse_location
from modelstage.core.manifest import MAX_MANIFEST_BYTES, FileEntry
from modelstage.core.s3_client import S3Options

from .engine_hardware import this_node

DEFAULT_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
RUNTIME_SUFFIXES = (".lock",)
"""Files the caches hold only while a process runs (inductor's ``locks/``): not kept."""
LOG_TAIL_LINES = 15
CONFIG_FACTORS = ("vllmVersion", "torchVersion", "modelPath", "engineArgs", "environment")
"""The factors of a cache's key that make up its serving configuration (``ServingConfig``):
what a rerun that finds the cache complete reports, as the first run did."""


def capture(
    artifact: str,
    out: str,
    args: EngineArgs,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 1800.0,
    hardware: HardwareClass | None = None,
    s3: S3Options | None = None,
) -> dict[str, Any]:
    """Capture once; an ``out`` that already holds a complete cache is left as it is."""
    weights = open_artifact(artifact, s3).read_manifest()
    if weights is None:
        raise ArtifactError(f"{artifact}: no modelstage.json: stage the artifact first")
    target = engine_cache_target(out, s3)
    existing = target.existing()
    if existing is not None:
        factors = existing.factors
        recorded = {k: factors.get(k) for k in CONFIG_FACTORS}
        return {"engineCache": out, "key": existing.key, "alreadyCaptured": True,
                "files": len(existing.files), "bytes": existing.bytes, "config": recorded,
                "hardware": factors.get("hardware")}  # fmt: skip
    started = time.monotonic()
    work = target.workdir()
    try:
        child_env = {**os.environ, **DEFAULT_ENV, **(env or {})}
        child_env.update({var: str(work / name) for name, var in ROOTS.items()})
        ran = run_engine(artifact, args, child_env, timeout, log=work.parent / f"{work.name}.log")
        config = ServingConfig(ran["vllmVersion"], ran["torchVersion"], artifact, args,
                               compile_environment(child_env))  # fmt: skip
        factors = key_factors(weights.digest, config, hardware or this_node())
        manifest = write_engine_cache(
            work, factors, time.monotonic() - started, ran["seconds"]["compile"]
        )
        target.publish(work, manifest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        (work.parent / f"{work.name}.log").unlink(missing_ok=True)
    return {
        "engineCache": out, "key": manifest.key, "files": len(manifest.files),
        "bytes": manifest.bytes, "compileSeconds": manifest.compileSeconds,
        "captureSeconds": manifest.captureSeconds, "tokenIds": ran["tokenIds"],
        "config": config.to_doc(), "hardware": factors["hardware"],
    }  # fmt: skip


class _Folder:
    """``--out`` a folder: the cache is written beside it and renamed into place."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def existing(self) -> EngineCacheManifest | None:
        try:
            raw = (self.out / ENGINE_MANIFEST).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DestinationError(
                f"{self.out / ENGINE_MANIFEST}: cannot read: {e.strerror}"
            ) from None
        return EngineCacheManifest.from_json(raw, str(self.out / ENGINE_MANIFEST))

    def workdir(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{self.out.name}.tmp-", dir=self.out.parent))

    def publish(self, work: Path, manifest: EngineCacheManifest) -> None:
        """Rename the finished folder to ``out``; an ``out`` without a manifest is a leftover."""
        del manifest  # already in ``work``
        if self.out.exists():
            shutil.rmtree(self.out)
        work.rename(self.out)
        fsync_dir(self.out.parent)


class _Prefix:
    """``--out`` an S3 prefix: the cache is written in a local temporary folder, then each
    file uploaded (boto3's managed transfer: bounded memory, parts retried) and the manifest
    last, so a reader that finds the manifest finds every file it lists."""

    def __init__(self, out: str, s3: S3Options | None) -> None:
        self.remote = S3Artifact.open(out, s3)

    def existing(self) -> EngineCacheManifest | None:
        raw = self.remote.get(ENGINE_MANIFEST, MAX_MANIFEST_BYTES + 1)
        if raw is None:
            return None
        return EngineCacheManifest.from_json(raw, self.remote.where(ENGINE_MANIFEST))

    def workdir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="engine-cache-"))

    def publish(self, work: Path, manifest: EngineCacheManifest) -> None:
        from boto3.s3.transfer import TransferConfig

        options = self.remote.s3.options
        config = TransferConfig(multipart_chunksize=options.part_bytes,
                                max_concurrency=options.concurrency)  # fmt: skip
        client, bucket = self.remote.s3.client, self.remote.location.bucket
        for name in sorted(manifest.files):
            key = self.remote.location.key(name)
            self.remote.call(
                lambda n=name, k=key: client.upload_file(str(work / n), bucket, k, Config=config),
                key,
            )
        key = self.remote.location.key(ENGINE_MANIFEST)
        body = (work / ENGINE_MANIFEST).read_bytes()
        self.remote.call(lambda: client.put_object(Bucket=bucket, Key=key, Body=body), key)


def engine_cache_target(out: str, s3: S3Options | None = None) -> _Folder | _Prefix:
    """Where ``--out`` publishes: a folder, or an S3 prefix."""
    location = parse_location(out)
    if location.kind == S3:
        return _Prefix(out, s3)
    return _Folder(location.path)


def run_engine(
    model: str, args: EngineArgs, env: dict[str, str], timeout: float, *, log: Path
) -> dict[str, Any]:
    """Start vLLM once in a child (``engine_run.py``); its JSON line, or the reason it failed
    with the last lines of its log."""
    argv = [sys.executable, "-m", "modelstage.stager.engine_run", "--model", model,
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


def _version() -> str:
    try:
        return dist_version("modelstage")
    except PackageNotFoundError:
        return "0+unknown"
