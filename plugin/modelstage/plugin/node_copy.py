"""Is this node's local copy of the artifact the artifact? The one check ``prepare`` and the
loader plugin share, so that the initContainer's verdict and the rank's choice agree.

The copy is the directory the pod mounts (its own copy, read-only: ``MODELSTAGE_NODE_CACHE``
points at it). It is trusted only when its manifest is the canonical form of the artifact's
(``core.node_cache.canonical_manifest``): a copy whose manifest is merely well-formed could
describe poisoned files consistently (its own chunk hashes matching its own bytes). Equal
manifests carry the artifact's chunk hashes, so every byte then read from the copy is checked
against the artifact's hashes as it streams in. Every file the manifest lists must be there, a
regular file of its size, and nothing else beside it (``core.structure``, the check ``verify``
and the node agent make too; what a partial or damaged copy fails), else the copy is a miss
and the artifact is read as without a cache. Nothing in the copy is opened through a link or
waited on (a FIFO). Never raises: a cache can only make a load faster, never make it fail to
start. Torch-free, so it is unit-tested without vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelstage.core.errors import ModelstageError
from modelstage.core.location import ArtifactLocation, LocalArtifact, S3Artifact
from modelstage.core.manifest import MANIFEST, Manifest, read_manifest_bytes
from modelstage.core.node_cache import HIT, MISS, canonical_manifest
from modelstage.core.s3_client import S3Client, S3Location
from modelstage.core.structure import check_structure, regular_sizes

LOG = logging.getLogger("vllm.modelstage")

MAX_REASON = 300
"""Reasons end up in a termination message (4 KiB for the whole summary)."""


@dataclass(frozen=True)
class NodeCopy:
    """The verdict on one node's copy: ``HIT`` with its directory, or ``MISS`` with why."""

    result: str
    path: Path | None = None
    reason: str = ""

    @property
    def hit(self) -> bool:
        return self.result == HIT

    def summary(self) -> dict[str, Any]:
        """``prepare``'s ``nodeCache`` field (the operator reads ``result``)."""
        if self.hit:
            return {"result": HIT, "path": str(self.path)}
        return {"result": MISS, "reason": self.reason}


def miss(reason: str) -> NodeCopy:
    return NodeCopy(MISS, reason=reason[:MAX_REASON])


def node_copy_for(directory: Path, digest: str | None, artifact: ArtifactLocation) -> NodeCopy:
    """The verdict on this node's copy (``directory``, the mounted copy) of ``artifact``
    (``digest``: the one the workload expects; None: the artifact manifest's own). A miss when
    the artifact is unreadable: its own checks then say why, without a cache in the way."""
    try:
        want = artifact.manifest_bytes()
        if digest is None and want is not None:
            digest = Manifest.from_json(want, artifact.where(MANIFEST)).digest
    except (ModelstageError, OSError) as e:
        return miss(f"cannot read the artifact's manifest: {e}")
    return check_node_copy(directory, digest or "", want)


def check_node_copy(directory: Path, digest: str, artifact_manifest: bytes | None) -> NodeCopy:
    """The verdict on the copy in ``directory`` against the artifact's manifest bytes."""
    if artifact_manifest is None:
        return miss("the artifact has no manifest to compare the node copy with")
    try:
        if not directory.is_dir():
            return miss(f"{directory}: no node copy mounted")
        copied = read_manifest_bytes(directory)
        if copied is None:
            return miss(f"{directory}: no {MANIFEST}; the copy is incomplete")
        if copied != canonical_manifest(artifact_manifest):
            return miss(
                f"{directory}/{MANIFEST} is not the artifact's manifest; the node copy is not "
                "this artifact"
            )
        manifest = Manifest.from_json(copied, str(directory / MANIFEST))
        if manifest.digest != digest:
            return miss(f"{directory}: holds artifact {manifest.digest}, not {digest}")
        check_structure(
            manifest.files, regular_sizes(directory), str(directory), lambda n: str(directory / n)
        )
    except (ModelstageError, OSError) as e:
        return miss(str(e))
    return NodeCopy(HIT, path=directory)


def choose_node_copy(
    directory: Path, digest: str | None, location: str, s3: S3Client | None = None
) -> NodeCopy:
    """The loader's choice for the artifact vLLM was pointed at (a directory, or an S3
    prefix read with ``s3``): this node's copy (the mounted ``directory``), or the artifact
    and why; logged either way."""
    node = _node_copy(directory, digest, location, s3)
    if node.hit:
        LOG.info(
            "modelstage: node cache hit: reading this rank's files from the node-local copy "
            "%s (its manifest equals the one of %s)",
            node.path,
            location,
        )
    else:
        LOG.info("modelstage: node cache miss: reading %s (%s)", location, node.reason)
    return node


def _node_copy(
    directory: Path, digest: str | None, location: str, s3: S3Client | None
) -> NodeCopy:
    if s3 is not None:
        try:
            artifact: ArtifactLocation = S3Artifact(S3Location.parse(location), s3)
        except ModelstageError as e:
            return miss(str(e))
    elif "://" in location:
        return miss(f"no node copy for a {location.split('://')[0]}:// artifact")
    else:
        artifact = LocalArtifact(location)
    return node_copy_for(directory, digest, artifact)
