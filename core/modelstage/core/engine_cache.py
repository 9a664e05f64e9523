"""The engine cache artifact: vLLM's and torch's compile caches, with a manifest of chunk hashes.

Layout: one folder per cache root, named after the variable that points vLLM or torch at it
(``ROOTS``), holding what the capture's start wrote there, and ``modelstage-engine-cache.json``
written last (its presence means complete; the capture renames a finished temporary folder
into place). The manifest is a sibling of the weights manifest (``manifest.py``): the same
``FileEntry`` per file (BLAKE3 chunk hashes, ``integrity.py``), with paths one level deeper
(``inductor/zw/c...so``), the key and the factors it was computed from (``engine_key.py``).

``decide`` is the pure half of ``prepare``'s use of a cache: given the manifest (or why there is
none) and the key factors of this start, a hit, or a miss with the reason; the content is
verified chunk by chunk by the shell on the copy it places, before vLLM starts.
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from .engine_key import differences, key_of
from .errors import ArtifactError
from .integrity import MAX_CHUNKS_PER_FILE, FileDigest
from .manifest import MAX_MANIFEST_BYTES, SAFE_FILE_NAME, FileEntry

ENGINE_MANIFEST = "modelstage-engine-cache.json"
ENGINE_SCHEMA = 1
KIND = "engineCache"
ROOTS = {
    "vllm": "VLLM_CACHE_ROOT",
    "inductor": "TORCHINDUCTOR_CACHE_DIR",
    "triton": "TRITON_CACHE_DIR",
}
"""Folder in the artifact -> the variable that points vLLM or torch at it. vLLM's own folder
(``torch_compile_cache/<hash>/``, ``modelinfos/``) sits under ``VLLM_CACHE_ROOT``
(``vllm/envs.py``); in vLLM's compile mode it points inductor and Triton below it too
(``InductorAdaptor.initialize_cache``, ``vllm/compilation/compiler_interface.py``); on the CPU
build with ``VLLM_USE_AOT_COMPILE=0`` inductor writes to ``TORCHINDUCTOR_CACHE_DIR``."""
MAX_DEPTH = 8
MAX_FILES = 200_000
HIT, MISS, CORRUPT, ABSENT = "hit", "miss", "corrupt", "absent"
RESULTS = (HIT, MISS, CORRUPT, ABSENT)
"""``absent``: no cache given or none captured yet; ``corrupt``: a damaged cache (its
manifest, its key or its bytes), which is also alerted on."""


def check_path(name: str) -> PurePosixPath:
    """A cache file's path: under one of ``ROOTS``, plain components (no ``..``, no leading dot,
    no absolute path), at most ``MAX_DEPTH`` deep. Nothing else is read or written."""
    path = PurePosixPath(name)
    parts = path.parts
    if (
        not 2 <= len(parts) <= MAX_DEPTH
        or parts[0] not in ROOTS
        or str(path) != name
        or not all(SAFE_FILE_NAME.match(p) for p in parts)
    ):
        raise ArtifactError(f"files.{name[:100]!r}: not a path an engine cache holds")
    return path


@dataclass(frozen=True)
class EngineCacheManifest:
    key: str
    factors: dict[str, Any]
    files: dict[str, FileEntry]
    bytes: int
    modelstageVersion: str
    createdAt: str
    captureSeconds: float
    compileSeconds: float
    kind: str = KIND
    schemaVersion: int = ENGINE_SCHEMA

    def to_json(self) -> str:
        doc = {
            "kind": self.kind,
            "schemaVersion": self.schemaVersion,
            "key": self.key,
            "factors": self.factors,
            "files": {name: entry.to_doc() for name, entry in sorted(self.files.items())},
            "bytes": self.bytes,
            "modelstageVersion": self.modelstageVersion,
            "createdAt": self.createdAt,
            "captureSeconds": self.captureSeconds,
            "compileSeconds": self.compileSeconds,
        }
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(raw: builtins.bytes | str, where: str) -> EngineCacheManifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{where}: invalid engine-cache manifest: too large")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ArtifactError(f"{where}: invalid engine-cache manifest: not JSON: {e}") from None
        try:
            return _parse(doc)
        except (ArtifactError, KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{where}: invalid engine-cache manifest: {e}") from None


def _parse(doc: Any) -> EngineCacheManifest:
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ArtifactError(f"kind: must be {KIND!r}")
    if doc.get("schemaVersion") != ENGINE_SCHEMA:
        raise ArtifactError(f"schemaVersion: {doc.get('schemaVersion')!r} is not one this "
                            f"modelstage reads ({ENGINE_SCHEMA}); upgrade modelstage")  # fmt: skip
    files = doc["files"]
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise ArtifactError(f"files: must be an object of at most {MAX_FILES} entries")
    for name in files:  # names first: nothing is reported under a name not ours
        check_path(name)
    entries = {name: _entry(name, entry) for name, entry in files.items()}
    for name in ("key", "modelstageVersion", "createdAt"):
        if not isinstance(doc[name], str):
            raise ArtifactError(f"{name}: must be a string")
    if not isinstance(doc["factors"], dict):
        raise ArtifactError("factors: must be an object")
    if sum(e.size for e in entries.values()) != doc["bytes"]:
        raise ArtifactError("bytes: not the sum of the files' sizes")
    return EngineCacheManifest(
        key=doc["key"],
        factors=doc["factors"],
        files=entries,
        bytes=int(doc["bytes"]),
        modelstageVersion=doc["modelstageVersion"],
        createdAt=doc["createdAt"],
        captureSeconds=float(doc["captureSeconds"]),
        compileSeconds=float(doc["compileSeconds"]),
    )


def _entry(name: str, entry: Any) -> FileEntry:
    if not isinstance(entry, dict) or set(entry) != {"size", "blake3", "chunkBytes", "chunks"}:
        raise ArtifactError(f"files.{name}: must be {{size, blake3, chunkBytes, chunks}}")
    chunks = entry["chunks"]
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS_PER_FILE:
        raise ArtifactError(f"files.{name}.chunks: must be a list of hex hashes")
    if not all(isinstance(c, str) and len(c) == 64 for c in chunks):
        raise ArtifactError(f"files.{name}.chunks: must be 64-digit hex hashes")
    size, chunk_bytes = entry["size"], entry["chunkBytes"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, chunk_bytes)):
        raise ArtifactError(f"files.{name}: size and chunkBytes must be integers")
    digest = FileDigest(size, chunk_bytes, tuple(chunks))
    return FileEntry(size, blake3=str(entry["blake3"]), chunkBytes=chunk_bytes,
                     chunks=digest.chunks)  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    """Whether this start uses the cache, and why not when it does not."""

    result: str
    reason: str = ""
    key: str = ""

    @property
    def used(self) -> bool:
        return self.result == HIT


def decide(manifest: EngineCacheManifest, wanted: dict[str, Any]) -> Verdict:
    """A cache is used only when its recorded factors hash to its recorded key (a manifest
    edited by hand is damaged, not a near-match) and equal this start's factors."""
    if key_of(manifest.factors) != manifest.key:
        return Verdict(CORRUPT, "the manifest's key is not the hash of its factors", manifest.key)
    wanted_key = key_of(wanted)
    if wanted_key == manifest.key:
        return Verdict(HIT, key=manifest.key)
    diff = differences(manifest.factors, wanted)
    reason = f"captured for another configuration ({'; '.join(diff) or 'key differs'})"
    return Verdict(MISS, reason, manifest.key)
