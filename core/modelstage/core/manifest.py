"""``modelstage.json``: the artifact's manifest, written last; its presence means complete.

Torch-free: the operator, the initContainer and the loader plugin all read it.
"""

from __future__ import annotations

import builtins
import json
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ArtifactError
from .formats import FORMATS
from .integrity import MAX_CHUNK_BYTES, MAX_CHUNKS_PER_FILE, FileDigest, open_regular

if TYPE_CHECKING:
    pass

MANIFEST = "modelstage.json"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""A manifest lists every file with its size and hash, about 150 bytes each: far below this."""
INDEX = "model.safetensors.index.json"
CARRIED_OVER = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "chat_template.json", "chat_template.jinja",
    "preprocessor_config.json",
)  # fmt: skip
"""Files vLLM reads beside the weights (config, tokenizer, generation defaults)."""
SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")
"""An artifact's files sit at its top level: a plain name, no path, no leading dot."""
SCHEMA_VERSION = 2
"""What writers produce. Schema 1 (still read): a sha256 per file. Schema 2: per file its
BLAKE3 chunk hashes and their root (``integrity.py``), so readers verify as they stream."""
SCHEMA_VERSIONS = (1, 2)
TIMING_FIELDS = ("createdAt", "stageSeconds")
"""Fields that differ between two runs producing the same bytes."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
"""Also the form of a BLAKE3 hash (32 bytes, hex)."""


@dataclass(frozen=True)
class FileEntry:
    """One file: schema 1 has ``sha256``; schema 2 ``blake3`` (the root), ``chunkBytes`` and
    ``chunks`` (``integrity.FileDigest``)."""

    size: int
    sha256: str | None = None
    blake3: str | None = None
    chunkBytes: int | None = None
    chunks: tuple[str, ...] | None = None

    @staticmethod
    def of(digest: FileDigest) -> FileEntry:
        return FileEntry(
            digest.size, blake3=digest.root, chunkBytes=digest.chunk_bytes, chunks=digest.chunks
        )

    @property
    def digest(self) -> FileDigest | None:
        """The chunk hashes (schema 2), None for a schema-1 entry."""
        if self.chunkBytes is None or self.chunks is None:
            return None
        return FileDigest(self.size, self.chunkBytes, self.chunks)

    def to_doc(self) -> dict[str, Any]:
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(self).items()
            if v is not None
        }


@dataclass(frozen=True)
class Manifest:
    """Plain dataclasses with explicit checks: the stager reads this on its start path, the
    loader plugin in every vLLM process; neither should pay for pydantic's import."""

    format: str
    tensorParallelSize: int
    dtype: str
    digest: str
    source: dict[str, Any]
    vllmVersion: str
    layoutVersion: str
    files: dict[str, FileEntry]
    bytes: int
    modelstageVersion: str
    createdAt: str = ""
    """Absent from a node copy's canonical manifest (``TIMING_FIELDS``), as ``stageSeconds``."""
    stageSeconds: float = 0.0
    pipelineParallelSize: int = 1
    schemaVersion: int = SCHEMA_VERSION
    pipelineLayerPartition: str = ""
    """Decoder layers per pipeline stage as ``VLLM_PP_LAYER_PARTITION`` spells them, where the
    stages were staged for one; "" (and absent from the file, which readers before it still
    read): vLLM's default partition."""

    def to_json(self) -> str:
        doc = asdict(self)
        if not self.pipelineLayerPartition:
            del doc["pipelineLayerPartition"]
        doc["files"] = {name: entry.to_doc() for name, entry in self.files.items()}
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @staticmethod
    def from_json(raw: builtins.bytes | str, where: str) -> Manifest:
        """Parse and check; ``raw`` longer than MAX_MANIFEST_BYTES (read with one byte to
        spare, so that a longer file shows) is refused unparsed."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{where}: invalid manifest: more than {MAX_MANIFEST_BYTES} bytes")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ArtifactError(f"{where}: invalid manifest: not JSON: {e}") from None
        try:
            return _parse(doc)
        except _Invalid as e:
            raise ArtifactError(f"{where}: invalid manifest: {e.loc}: {e.msg}") from None

    def check_expected(
        self,
        where: str,
        *,
        digest: str | None = None,
        tp: int | None = None,
        pp: int | None = None,
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
        if pp is not None and self.pipelineParallelSize != pp:
            raise ArtifactError(
                f"{where}: artifact was staged for pipeline parallel size "
                f"{self.pipelineParallelSize}, but the workload runs {pp}; stage it for {pp}"
            )


class _Invalid(Exception):
    def __init__(self, loc: str, msg: str) -> None:
        self.loc, self.msg = loc, msg


_FIELD_TYPES = {f.name: f.type for f in fields(Manifest)}


def _parse(doc: object) -> Manifest:
    if not isinstance(doc, dict):
        raise _Invalid("(root)", "must be a JSON object")
    unknown = sorted(set(doc) - set(_FIELD_TYPES))
    if unknown:
        raise _Invalid(unknown[0], "extra fields not permitted")
    required = [f.name for f in fields(Manifest) if f.default is MISSING]
    for name in required:
        if name not in doc:
            raise _Invalid(name, "field required")
    values = _scalars(dict(doc))
    if not isinstance(values["source"], dict):
        raise _Invalid("source", "must be an object")
    files = values["files"]
    if not isinstance(files, dict):
        raise _Invalid("files", "must be an object")
    version = values.setdefault("schemaVersion", 1)
    if version not in SCHEMA_VERSIONS:
        raise _Invalid(
            "schemaVersion",
            f"{version} is not one this modelstage reads "
            f"({', '.join(map(str, SCHEMA_VERSIONS))}); upgrade modelstage",
        )
    for name in files:  # names first: nothing is read or reported under a name not ours
        _check_file_name(name, values["format"])
    entry = _entry if version == 1 else _chunked_entry
    values["files"] = {name: entry(f"files.{name}", e) for name, e in files.items()}
    return Manifest(**values)


def _scalars(values: dict[str, Any]) -> dict[str, Any]:
    """The scalar fields checked: integers, strings and the one number."""
    for name in ("tensorParallelSize", "pipelineParallelSize", "schemaVersion", "bytes"):
        if name in values:
            low = 0 if name == "bytes" else 1
            values[name] = _int(name, values[name], low)
    for name in (
        "format",
        "dtype",
        "digest",
        "vllmVersion",
        "layoutVersion",
        "modelstageVersion",
        "createdAt",
        "pipelineLayerPartition",
    ):
        if not isinstance(values.setdefault(name, ""), str):
            raise _Invalid(name, "must be a string")
    seconds = values.setdefault("stageSeconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise _Invalid("stageSeconds", "must be a number")
    values["stageSeconds"] = float(seconds)
    return values


def _check_file_name(name: str, format: str) -> None:
    """Only names the format writes: a manifest naming ``/etc/hostname`` or ``../x`` is not
    one modelstage wrote, and no reader may stat, hash or load what it names."""
    known = FORMATS.get(format)
    if (
        not SAFE_FILE_NAME.match(name)
        or name == MANIFEST
        or (
            known is not None
            and not known.weight_files.match(name)
            and name not in CARRIED_OVER
            and not (name == INDEX and known.index_file)
        )
    ):
        raise _Invalid(f"files.{name[:100]!r}", f"not a file name a {format} artifact has")


def _int(loc: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(loc, "must be an integer")
    if value < low:
        raise _Invalid(loc, f"must be at least {low}")
    return value


def _entry(loc: str, entry: object) -> FileEntry:
    if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
        raise _Invalid(loc, 'must be {"size": bytes, "sha256": hex}')
    sha256 = entry["sha256"]
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        raise _Invalid(f"{loc}.sha256", "must be 64 lower-case hex digits")
    return FileEntry(_int(f"{loc}.size", entry["size"], 0), sha256)


def _chunked_entry(loc: str, entry: object) -> FileEntry:
    keys = {"size", "blake3", "chunkBytes", "chunks"}
    if not isinstance(entry, dict) or set(entry) != keys:
        raise _Invalid(
            loc, 'must be {"size": bytes, "blake3": hex, "chunkBytes": bytes, "chunks": [hex, ...]}'
        )
    size = _int(f"{loc}.size", entry["size"], 0)
    chunk_bytes = _int(f"{loc}.chunkBytes", entry["chunkBytes"], 1)
    if chunk_bytes > MAX_CHUNK_BYTES:
        raise _Invalid(
            f"{loc}.chunkBytes",
            f"{chunk_bytes} is more than {MAX_CHUNK_BYTES} (64 MiB), the largest chunk a reader "
            "holds in memory; restage the artifact with this release",
        )
    chunks = entry["chunks"]
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS_PER_FILE:
        raise _Invalid(f"{loc}.chunks", "must be a list of hex hashes")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, str) or not _SHA256.match(chunk):
            raise _Invalid(f"{loc}.chunks[{i}]", "must be 64 lower-case hex digits")
    try:
        digest = FileDigest(size, chunk_bytes, tuple(chunks))
    except ValueError as e:
        raise _Invalid(f"{loc}.chunks", str(e)) from None
    root = entry["blake3"]
    if not isinstance(root, str) or not _SHA256.match(root):
        raise _Invalid(f"{loc}.blake3", "must be 64 lower-case hex digits")
    # The root is checked against the chunks where content is hashed: parsing needs no blake3.
    return FileEntry(size, blake3=root, chunkBytes=chunk_bytes, chunks=digest.chunks)


def read_manifest(directory: Path) -> Manifest | None:
    path = directory / MANIFEST
    try:
        raw = read_manifest_bytes(directory)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read: {e.strerror}") from None
    return None if raw is None else Manifest.from_json(raw, str(path))


def read_manifest_bytes(directory: Path) -> bytes | None:
    """The manifest file's bytes as stored, at most one more than any valid manifest (longer
    is refused when parsed); None when there is none. Only a regular file is read: a link is
    not followed and a FIFO not waited on (``integrity.open_regular``: an ``OSError``, the
    caller's, like any other)."""
    try:
        fd = open_regular(directory / MANIFEST)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        return f.read(MAX_MANIFEST_BYTES + 1)


def check_ranks_present(directory: Path | str, manifest: Manifest) -> None:
    """Refuse a per-rank artifact whose manifest lacks some rank's files."""
    known = FORMATS.get(manifest.format)
    if known is None or not known.per_rank:
        return
    pp = manifest.pipelineParallelSize
    for pp_rank in range(pp):
        for rank in range(manifest.tensorParallelSize):
            if not any(known.is_rank_file(name, rank, pp_rank, pp) for name in manifest.files):
                stage = f" of pipeline stage {pp_rank}" if pp > 1 else ""
                raise ArtifactError(
                    f"{directory}: the manifest lists no file for rank {rank}{stage}"
                )
