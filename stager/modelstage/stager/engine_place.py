"""``prepare``'s engine cache: verify it, check its key, place it where vLLM looks.

The destination is the folder the vLLM container mounts (an ``emptyDir``), with one folder
per cache root (``ROOTS``) and the variables that point vLLM and torch at them (``env``); the
roots exist, empty, whatever the verdict, so that a start without a usable cache compiles into
the same folders as it would have. A cache is used only when it is complete (its manifest), its
key is the hash of this start's factors (``decide``) and every byte of the copy placed matches
the manifest's chunk hashes (``integrity.hash_local_files``, the same check as the weights):
the copy is verified, not the source, so what vLLM reads is what was checked. Anything else
is a verdict, never a failure: the reason is in the summary and the log, and the start goes
on, compiling as it would have.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelstage.core.engine_cache import (
    ABSENT,
    CORRUPT,
    ENGINE_MANIFEST,
    HIT,
    ROOTS,
    EngineCacheManifest,
    Verdict,
    decide,
)
from modelstage.core.errors import ArtifactError, DestinationError, ModelstageError
from modelstage.core.formats import S3
from modelstage.core.integrity import hash_local_files
from modelstage.core.location import LocalArtifact, S3Artifact, parse_location
from modelstage.core.manifest import MAX_MANIFEST_BYTES

if TYPE_CHECKING:
    from modelstage.core.s3_client import S3Options

COPY_BLOCK = 8 * 1024 * 1024


def cache_env(dest: Path) -> dict[str, str]:
    """The variables the vLLM container gets (the operator sets them; the summary repeats
    them): each cache root under ``dest``."""
    return {var: str(dest / name) for name, var in ROOTS.items()}


def place_engine_cache(
    source: str | None, dest: Path, wanted: dict[str, Any], s3: S3Options | None = None
) -> dict[str, Any]:
    """The verdict and the seconds it took; the cache placed under ``dest`` on a hit."""
    started = time.monotonic()
    _empty_roots(dest)
    seconds: dict[str, float] = {}
    if source is None:
        verdict = Verdict(ABSENT, "no engine cache given")
    else:
        verdict, seconds = _try(source, dest, wanted, s3)
    if not verdict.used:
        print(f"engine cache not used ({verdict.result}): {verdict.reason}", file=sys.stderr)
    return {
        "result": verdict.result, "reason": verdict.reason, "key": verdict.key,
        "source": source or "", "env": cache_env(dest),
        "seconds": {**seconds, "total": round(time.monotonic() - started, 3)},
    }  # fmt: skip


def _try(
    source: str, dest: Path, wanted: dict[str, Any], s3: S3Options | None
) -> tuple[Verdict, dict[str, float]]:
    seconds: dict[str, float] = {}
    try:
        reader = _reader(source, s3)
        raw = reader.get(ENGINE_MANIFEST, MAX_MANIFEST_BYTES + 1)
        if raw is None:
            return Verdict(ABSENT, f"{source}: no {ENGINE_MANIFEST}: not captured yet"), seconds
        manifest = EngineCacheManifest.from_json(raw, f"{source}/{ENGINE_MANIFEST}")
    except (ModelstageError, OSError) as e:
        return Verdict(CORRUPT, f"cannot read the engine cache: {e}"), seconds
    verdict = decide(manifest, wanted)
    if not verdict.used:
        return verdict, seconds
    work = Path(tempfile.mkdtemp(prefix=".engine-cache-", dir=dest))
    try:
        t0 = time.monotonic()
        names = sorted(manifest.files)
        reader.copy(names, work)
        t1 = time.monotonic()
        expected = [manifest.files[n].digest for n in names]
        hash_local_files([work / n for n in names], expected, recorded="the engine-cache manifest")
        t2 = time.monotonic()
        for name in ROOTS:
            if (work / name).is_dir():
                os.rmdir(dest / name)
                (work / name).rename(dest / name)
        seconds = {"copy": round(t1 - t0, 3), "verify": round(t2 - t1, 3),
                   "place": round(time.monotonic() - t2, 3)}  # fmt: skip
    except (ModelstageError, OSError, ValueError) as e:
        _empty_roots(dest)
        return Verdict(CORRUPT, f"refused: {e}", manifest.key), seconds
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Verdict(HIT, key=manifest.key), seconds


def _empty_roots(dest: Path) -> None:
    """Each root, empty: where vLLM compiles when no cache is used. A folder that cannot be
    written is the pod's mistake (the volume is not mounted writable), not the cache's."""
    try:
        for name in ROOTS:
            shutil.rmtree(dest / name, ignore_errors=True)
            (dest / name).mkdir(parents=True)
    except OSError as e:
        raise DestinationError(
            f"{dest}: cannot prepare the engine-cache folders: {e.strerror}; mount a writable "
            "volume (an emptyDir) there"
        ) from None


class _Reader:
    """Reads a cache's manifest and copies its files, from a folder or an S3 prefix."""

    def __init__(self, local: LocalArtifact | None, remote: S3Artifact | None) -> None:
        self.local, self.remote = local, remote

    def get(self, name: str, limit: int) -> bytes | None:
        if self.remote is not None:
            return self.remote.get(name, limit)
        assert self.local is not None
        try:
            with open(self.local.directory / name, "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            return None

    def copy(self, names: list[str], work: Path) -> None:
        listing = self.remote.listing() if self.remote is not None else {}
        for name in names:
            target = work / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if self.remote is not None:
                listed = listing.get(name)
                if listed is None or listed.size is None:
                    raise ArtifactError(f"{self.remote.where(name)}: missing")
                _download(self.remote, name, listed.etag or "", listed.size, target)
            else:
                assert self.local is not None
                _copy_regular(self.local.directory, name, target)


def _reader(source: str, s3: S3Options | None) -> _Reader:
    location = parse_location(source)
    if location.kind == S3:
        return _Reader(None, S3Artifact.open(source, s3))
    return _Reader(LocalArtifact(location.path), None)


def _copy_regular(root: Path, name: str, target: Path) -> None:
    """Copy one file, refusing a link anywhere below the cache's root (hostile input)."""
    parts = Path(name).parts
    for depth in range(1, len(parts)):
        if (root.joinpath(*parts[:depth])).is_symlink():
            raise ArtifactError(f"{root / name}: a link in the engine cache; refused")
    source = root / name
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArtifactError(f"{source}: not a regular file; refused")
        with os.fdopen(fd, "rb", closefd=False) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, COPY_BLOCK)
    finally:
        os.close(fd)


def _download(remote: S3Artifact, name: str, etag: str, size: int, target: Path) -> None:
    read_into = remote.read_into(name, etag)
    buf = memoryview(bytearray(min(size, COPY_BLOCK) or 1))
    with open(target, "wb") as dst:
        offset = 0
        while offset < size:
            n = min(len(buf), size - offset)
            read_into(offset, buf[:n])
            dst.write(buf[:n])
            offset += n
