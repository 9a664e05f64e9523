"""The node root as the agent sees it: what it holds (scan), the copies' records, removal and
warming. Every path is the root joined with a checked digest (``core.node_cache``); entries
that are not ours (other names, links) are neither read nor removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from modelstage.core import node_cache
from modelstage.core.errors import ModelstageError
from modelstage.core.manifest import MANIFEST, Manifest, read_manifest

from .locks import is_locked, own_dir, try_digest_lock, write_atomic

WARM_BLOCK = 8 * 1024 * 1024
"""Read size while warming: memory stays at one block whatever the artifact's size."""


@dataclass(frozen=True)
class Copy:
    """A complete copy: its manifest present and every file of the manifest's size."""

    digest: str
    bytes: int
    files: int
    record: dict[str, Any] = field(default_factory=dict)
    """``.state/<digest>.json`` (empty when missing or unreadable)."""


@dataclass(frozen=True)
class Partial:
    digest: str
    bytes: int
    locked: bool


@dataclass
class Scan:
    copies: list[Copy] = field(default_factory=list)
    partials: list[Partial] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    """Broken copies removed by this scan, with why (for the report's message)."""


def _is_digest(name: str) -> bool:
    try:
        node_cache.check_digest(name)
    except ModelstageError:
        return False
    return True


def _dir_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def read_record(root: Path, digest: str) -> dict[str, Any]:
    try:
        record = json.loads(node_cache.state_file(root, digest).read_bytes())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_record(root: Path, digest: str, record: dict[str, Any]) -> None:
    own_dir(root / node_cache.STATE)
    write_atomic(node_cache.state_file(root, digest), json.dumps(record).encode())


def check_copy(directory: Path) -> tuple[Manifest | None, str]:
    """The copy's manifest when it is complete (present, parsed, every file a regular file of
    the manifest's size), else None and why."""
    try:
        manifest = read_manifest(directory)
    except ModelstageError as e:
        return None, str(e)
    if manifest is None:
        return None, f"no {MANIFEST}"
    if manifest.digest != directory.name:
        return None, f"its manifest is of artifact {manifest.digest}"
    for name, entry in manifest.files.items():
        try:
            stat = os.stat(directory / name, follow_symlinks=False)
        except FileNotFoundError:
            return None, f"{name} is missing"
        if not os.path.isfile(directory / name) or os.path.islink(directory / name):
            return None, f"{name} is not a regular file"
        if stat.st_size != entry.size:
            return None, f"{name}: {stat.st_size} bytes, the manifest says {entry.size}"
    return manifest, ""


def scan(root: Path) -> Scan:
    """What the root holds; a ``<digest>`` directory that is not a complete copy (a removal
    that stopped, a file truncated or replaced) is removed, unless a copier holds its lock."""
    result = Scan()
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not _is_digest(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        manifest, why = check_copy(Path(entry.path))
        if manifest is None:
            if remove_copy(root, entry.name):
                result.removed.append(f"{entry.name}: {why}")
            continue
        result.copies.append(
            Copy(entry.name, manifest.bytes, len(manifest.files), read_record(root, entry.name))
        )
    partial_root = root / node_cache.PARTIAL
    if partial_root.is_dir():
        for entry in sorted(os.scandir(partial_root), key=lambda e: e.name):
            if not _is_digest(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            locked = is_locked(node_cache.lock_file(root, entry.name))
            result.partials.append(Partial(entry.name, _dir_bytes(Path(entry.path)), locked))
    return result


def remove_copy(root: Path, digest: str) -> bool:
    """Remove ``<digest>`` (manifest first: it never looks complete half-removed) and its
    record; False when a copier holds the digest's lock (left alone)."""
    own_dir(root / node_cache.PARTIAL)
    with try_digest_lock(node_cache.lock_file(root, digest), unlink=True) as free:
        if not free:
            return False
        directory = node_cache.copy_dir(root, digest)
        if directory.is_dir() and not directory.is_symlink():
            (directory / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(directory)
        node_cache.state_file(root, digest).unlink(missing_ok=True)
    return True


def remove_partial(root: Path, digest: str) -> bool:
    """Remove an abandoned ``.partial/<digest>``; False when a copier holds its lock."""
    with try_digest_lock(node_cache.lock_file(root, digest), unlink=True) as free:
        if not free:
            return False
        directory = node_cache.partial_dir(root, digest)
        if directory.is_dir() and not directory.is_symlink():
            shutil.rmtree(directory)
    return True


def touch(root: Path, copy: Copy, now: datetime) -> tuple[Copy, str]:
    """Record that a ModelDeployment uses the copy now (its ``lastUsed``), merged into the
    record as it is on disk now (the copier may have written it since the scan); the copy as
    recorded, and why nothing was recorded when that failed (a full disk: the caller goes on,
    since eviction is what frees it). Skipped while a copier holds the digest's lock: it
    writes the record itself, ``lastUsed`` included."""
    try:
        own_dir(root / node_cache.PARTIAL)
        with try_digest_lock(node_cache.lock_file(root, copy.digest), unlink=True) as free:
            if not free:
                return copy, ""
            record = {**read_record(root, copy.digest), "digest": copy.digest,
                      "lastUsed": now.isoformat()}  # fmt: skip
            write_record(root, copy.digest, record)
    except OSError as e:
        return copy, f"cannot record the use of {copy.digest}: {e.strerror or e}"
    return Copy(copy.digest, copy.bytes, copy.files, record), ""


def warm(root: Path, digest: str, stop: Any = None) -> float:
    """Read the copy's files into the page cache (``posix_fadvise`` WILLNEED, then a read of
    every block into one reused buffer); the seconds it took. ``stop``: an Event that ends it
    early (the agent shutting down)."""
    started = time.monotonic()
    directory = node_cache.copy_dir(root, digest)
    manifest = read_manifest(directory)
    if manifest is None:
        raise FileNotFoundError(f"{directory}: no {MANIFEST}")
    buf = bytearray(WARM_BLOCK)
    for name in sorted(manifest.files):
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            while os.readv(fd, [buf]) > 0:
                if stop is not None and stop.is_set():
                    break
        finally:
            os.close(fd)
    return time.monotonic() - started
