"""Helpers of the node cache tests (tests/node_cache): the staged artifacts' chunk size,
digests, and hand-made copies in the on-node layout for the agent's bookkeeping."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from modelstage.core import node_cache
from modelstage.core.integrity import digest_bytes
from modelstage.core.manifest import MANIFEST, FileEntry, Manifest

CHUNK = 256 * 1024
"""Hash chunk of the staged test artifacts: a rank file holds several."""


def digest_of(artifact: Path) -> str:
    digest: str = json.loads((artifact / MANIFEST).read_text())["digest"]
    return digest


def fake_digest(i: int) -> str:
    """A well-formed digest of a hand-made copy."""
    return f"{i:02x}" * 32


def make_copy(
    root: Path, digest: str, size: int, *, last_used: datetime | None = None, partial: bool = False
) -> Path:
    """A complete copy (or a partial one, no manifest) of ``size`` bytes under ``root``, in
    the on-node layout, with its record."""
    directory = node_cache.partial_dir(root, digest) if partial else node_cache.copy_dir(root, digest)
    directory.mkdir(parents=True)
    data = os.urandom(size)
    (directory / "model.safetensors").write_bytes(data)
    if partial:
        return directory
    manifest = Manifest(
        format="safetensors", tensorParallelSize=1, dtype="float32", digest=digest, source={},
        vllmVersion="0.32", layoutVersion="1", files={"model.safetensors": FileEntry.of(digest_bytes(data))},
        bytes=size, modelstageVersion="0.1.0", createdAt="2026-01-01T00:00:00Z", stageSeconds=1.0,
    )  # fmt: skip
    (directory / MANIFEST).write_text(manifest.to_json())
    record = {"digest": digest, "bytes": size, "files": 1, "copiedAt": "2026-01-01T00:00:00+00:00",
              "copySeconds": 2.0}  # fmt: skip
    if last_used is not None:
        record["lastUsed"] = last_used.isoformat()
    state = node_cache.state_file(root, digest)
    state.parent.mkdir(exist_ok=True)
    state.write_text(json.dumps(record))
    return directory
