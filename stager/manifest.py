"""``modelstage.json``: the artifact's manifest, written last; its presence means complete.

Torch-free: the operator, the initContainer and the loader plugin all read it.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ArtifactError

MANIFEST = "modelstage.json"
SCHEMA_VERSION = 1
TIMING_FIELDS = ("createdAt", "stageSeconds")
"""Fields that differ between two runs producing the same bytes."""
HASH_BLOCK = 8 * 1024 * 1024


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schemaVersion: int = SCHEMA_VERSION
    format: str
    tensorParallelSize: int = Field(ge=1)
    pipelineParallelSize: int = Field(default=1, ge=1)
    dtype: str
    digest: str
    source: dict[str, Any]
    vllmVersion: str
    layoutVersion: str
    files: dict[str, FileEntry]
    bytes: int = Field(ge=0)
    modelstageVersion: str
    createdAt: str
    stageSeconds: float

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True) + "\n"

    @staticmethod
    def from_json(raw: builtins.bytes | str, where: str) -> Manifest:
        try:
            return Manifest.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first["loc"])
            raise ArtifactError(f"{where}: invalid manifest: {loc}: {first['msg']}") from None

    def check_expected(
        self, where: str, *, digest: str | None = None, tp: int | None = None
    ) -> None:
        """Refuse an artifact that is not the one the caller was told to use."""
        if digest is not None and self.digest != digest:
            raise ArtifactError(
                f"{where}: artifact digest is {self.digest}, expected {digest}; the artifact "
                "belongs to another spec; re-stage or point at the right artifact"
            )
        if tp is not None and self.tensorParallelSize != tp:
            raise ArtifactError(
                f"{where}: artifact was staged for tensor parallel size "
                f"{self.tensorParallelSize}, but the workload runs {tp}; stage it for {tp}"
            )


def read_manifest(directory: Path) -> Manifest | None:
    path = directory / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read: {e.strerror}") from None
    return Manifest.from_json(raw, str(path))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def verify_directory(
    directory: Path,
    *,
    digest: str | None = None,
    tp: int | None = None,
    hash_content: bool = True,
) -> Manifest:
    """Check a local artifact against its manifest; raise ArtifactError at the first problem."""
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such artifact directory")
    manifest = read_manifest(directory)
    if manifest is None:
        raise ArtifactError(f"{directory}: no {MANIFEST}; the artifact is incomplete")
    manifest.check_expected(str(directory), digest=digest, tp=tp)
    check_ranks_present(directory, manifest)
    for name, entry in sorted(manifest.files.items()):
        path = directory / name
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise ArtifactError(f"{path}: listed in the manifest but missing") from None
        if size != entry.size:
            raise ArtifactError(f"{path}: {size} bytes, the manifest says {entry.size}")
        if hash_content and sha256_file(path) != entry.sha256:
            raise ArtifactError(f"{path}: sha256 differs from the manifest; the file is corrupt")
    extra = sorted(
        p.name for p in directory.iterdir() if p.name not in manifest.files and p.name != MANIFEST
    )
    if extra:
        raise ArtifactError(f"{directory}: files not in the manifest: {', '.join(extra[:5])}")
    return manifest


def check_ranks_present(directory: Path | str, manifest: Manifest) -> None:
    """Refuse a per-rank artifact whose manifest lacks some rank's files."""
    if manifest.format not in ("sharded_state", "runai_streamer_sharded", "tensorizer"):
        return
    for rank in range(manifest.tensorParallelSize):
        marker = f"-rank-{rank}-" if manifest.format != "tensorizer" else f"-rank-{rank:03d}."
        if not any(marker in name for name in manifest.files):
            raise ArtifactError(f"{directory}: the manifest lists no file for rank {rank}")
