"""The node root as the agent sees it: what it holds (scan), the copies' records, removal,
warming and re-verification.

The root is treated as hostile: every open is ``O_NOFOLLOW | O_NONBLOCK`` (a link is never
followed, a FIFO never waited on) and checked with ``fstat`` to be the kind expected; sizes
come from what is on the disk, never from a manifest or a record. An entry that cannot be read
(a link, a FIFO, a directory without permissions, a record that is not JSON) is reported and
skipped: the scan goes on with the others. Every path is the root joined with a checked
content (``core.node_cache``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from modelstage.core import node_cache
from modelstage.core.durable import write_atomic
from modelstage.core.errors import ArtifactError, ModelstageError
from modelstage.core.integrity import FileDigest, blake3_module, open_regular
from modelstage.core.manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest
from modelstage.core.structure import check_structure, regular_sizes

from .locks import digest_lock, is_locked, own_dir, try_digest_lock

WARM_BLOCK = 8 * 1024 * 1024
"""Read size while warming and verifying: memory stays at one block whatever the copy."""
MAX_RECORD_BYTES = 1024 * 1024
"""A record is a few hundred bytes plus its grants: anything longer is not one of ours."""
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
GrantKey = tuple[str, str]
"""(namespace, spec digest)."""


@dataclass(frozen=True)
class Copy:
    """A complete copy: its canonical manifest present, naming exactly the regular files there,
    each of the manifest's size."""

    content: str
    bytes: int
    """Counted from the disk: the files' and the manifest's sizes."""
    files: int
    record: dict[str, Any] = field(default_factory=dict)
    """``.state/<content>.json`` (empty when missing or unreadable)."""

    @property
    def grants(self) -> list[GrantKey]:
        return record_grants(self.record)


@dataclass(frozen=True)
class Partial:
    content: str
    bytes: int


@dataclass
class Scan:
    copies: list[Copy] = field(default_factory=list)
    partials: list[Partial] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    """Incomplete copies removed by this scan, with why."""
    problems: list[str] = field(default_factory=list)
    """Entries that could not be read, with why: skipped, left as they are."""

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.copies) + sum(p.bytes for p in self.partials)


def record_time(value: Any) -> datetime | None:
    """A time a record holds (ISO 8601; UTC when it names no zone), None when it holds none."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def is_content(name: str) -> bool:
    try:
        node_cache.check_content(name)
    except ModelstageError:
        return False
    return True


@contextlib.contextmanager
def open_dir(path: Path | str, dir_fd: int | None = None) -> Iterator[int]:
    """A directory's descriptor, never through a link (``OSError`` otherwise)."""
    fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _read_regular(name: str | Path, limit: int, dir_fd: int | None = None) -> bytes:
    fd = open_regular(name, dir_fd=dir_fd)
    with open(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"more than {limit} bytes", str(name))
    return data


def check_copy(fd: int, content: str) -> tuple[Manifest | None, int, str]:
    """The copy's manifest and its bytes on disk when the open directory is the complete copy
    of ``content`` (``core.structure``), else None and why, naming the content."""
    try:
        raw = _read_regular(MANIFEST, MAX_MANIFEST_BYTES, fd)
    except FileNotFoundError:
        return None, 0, f"{content}: no {MANIFEST}"
    if raw != node_cache.canonical_manifest(raw) or node_cache.content_address(raw) != content:
        return None, 0, f"{content}: its {MANIFEST} is not the canonical manifest of this content"
    manifest = Manifest.from_json(raw, f"{content}/{MANIFEST}")
    try:
        check_structure(manifest.files, regular_sizes(fd), content, lambda n: f"{content}/{n}")
    except ArtifactError as e:
        return None, 0, str(e)
    return manifest, manifest.bytes + len(raw), ""


def scan(root: Path) -> Scan:
    """What the root holds. A ``<content>`` directory that is not a complete copy (a removal
    that stopped half-way, a file truncated) is removed unless a writer holds its lock; an
    entry that cannot be read is reported and skipped. ``OSError`` only for the root itself."""
    result = Scan()
    with open_dir(root) as root_fd:
        for name in sorted(os.listdir(root_fd)):
            if is_content(name):
                try:
                    _scan_copy(root, root_fd, name, result)
                except (OSError, ModelstageError) as e:
                    result.problems.append(f"{name}: {_why(e)}; skipped")
    result.partials = _scan_partials(root, result.problems)
    return result


def _why(e: BaseException) -> str:
    return str(e.strerror or e) if isinstance(e, OSError) else str(e)


def _scan_copy(root: Path, root_fd: int, content: str, result: Scan) -> None:
    with open_dir(content, root_fd) as fd:
        manifest, size, why = check_copy(fd, content)
    if manifest is None:
        if remove_copy(root, content):
            result.removed.append(why)
        return
    result.copies.append(Copy(content, size, len(manifest.files), read_record(root, content)))


def _scan_partials(root: Path, problems: list[str]) -> list[Partial]:
    partials: list[Partial] = []
    try:
        with open_dir(root / node_cache.PARTIAL) as parent:
            for name in sorted(os.listdir(parent)):
                if not is_content(name):
                    continue
                try:
                    with open_dir(name, parent) as fd:
                        sizes = regular_sizes(fd)
                except OSError as e:
                    problems.append(f"{node_cache.PARTIAL}/{name}: {_why(e)}; skipped")
                    continue
                partials.append(Partial(name, sum(s for s in sizes.values() if s > 0)))
    except FileNotFoundError:
        pass
    except OSError as e:
        problems.append(f"{node_cache.PARTIAL}: {_why(e)}; skipped")
    return partials


def record_grants(record: dict[str, Any]) -> list[GrantKey]:
    """The well-formed grants of a record (anything else in it is ignored)."""
    grants = record.get("grants")
    found: list[GrantKey] = []
    for g in grants if isinstance(grants, list) else []:
        ns, digest = (g.get("namespace"), g.get("digest")) if isinstance(g, dict) else (0, 0)
        if isinstance(ns, str) and isinstance(digest, str) and (ns, digest) not in found:
            found.append((ns, digest))
    return found


def read_record(root: Path, content: str) -> dict[str, Any]:
    try:
        record = json.loads(_read_regular(node_cache.state_file(root, content), MAX_RECORD_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def write_record(root: Path, content: str, record: dict[str, Any]) -> None:
    """The record, 0600 in a 0700 directory: grants name namespaces, no other tenant reads it."""
    state = own_dir(root / node_cache.STATE)
    os.chmod(state, 0o700)
    data = json.dumps(record, sort_keys=True).encode()
    write_atomic(node_cache.state_file(root, content), data, 0o600)


def update_record(root: Path, content: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Read, change and write the record (the caller holds the content's lock)."""
    record = read_record(root, content)
    change(record)
    record["content"] = content
    write_record(root, content, record)


def remove_tree(path: Path) -> None:
    """``path`` and what it holds, never through a link; made writable first (copies are
    0550: nothing could be unlinked from them otherwise)."""
    try:
        with open_dir(path) as fd:
            os.fchmod(fd, 0o700)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(MANIFEST, dir_fd=fd)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(path)  # a link or a file where a directory was: the entry itself goes
        return
    shutil.rmtree(path)


def remove_copy(root: Path, content: str) -> bool:
    """Remove ``<content>`` (manifest first: it never looks complete half-removed) and its
    record; False when a writer holds the content's lock (left alone)."""
    own_dir(root / node_cache.PARTIAL)
    with try_digest_lock(node_cache.lock_file(root, content), unlink=True) as free:
        if not free:
            return False
        remove_tree(node_cache.copy_dir(root, content))
        node_cache.state_file(root, content).unlink(missing_ok=True)
    return True


def remove_partial(root: Path, content: str) -> bool:
    """Remove an abandoned ``.partial/<content>``; False when a writer holds its lock."""
    with try_digest_lock(node_cache.lock_file(root, content), unlink=True) as free:
        if not free:
            return False
        remove_tree(node_cache.partial_dir(root, content))
    return True


def partial_locked(root: Path, content: str) -> bool:
    return is_locked(node_cache.lock_file(root, content))


def touch(root: Path, copy: Copy, now: datetime) -> tuple[Copy, str]:
    """Record that the spec keeps the copy now (its ``lastUsed``); the copy as recorded, and
    why nothing was recorded when that failed (a full disk: the caller goes on, since
    eviction is what frees it). Skipped while a writer holds the content's lock."""
    try:
        own_dir(root / node_cache.PARTIAL)
        with try_digest_lock(node_cache.lock_file(root, copy.content)) as free:
            if not free:
                return copy, ""
            record = read_record(root, copy.content)
            record |= {"content": copy.content, "lastUsed": now.isoformat()}
            write_record(root, copy.content, record)
    except OSError as e:
        return copy, f"cannot record the use of {copy.content}: {e.strerror or e}"
    return Copy(copy.content, copy.bytes, copy.files, record), ""


def _copy_manifest(fd: int, content: str) -> Manifest:
    manifest, _, why = check_copy(fd, content)
    if manifest is None:
        raise ArtifactError(f"not a complete copy: {why}")
    return manifest


def warm(root: Path, content: str, stop: Any = None) -> float:
    """Read the copy's files into the page cache (``posix_fadvise`` WILLNEED, then a read of
    every block into one reused buffer); the seconds it took. ``stop``: an Event that ends it
    early (the agent shutting down)."""
    started = time.monotonic()
    buf = bytearray(WARM_BLOCK)
    with open_dir(node_cache.copy_dir(root, content)) as dir_fd:
        for name in sorted(_copy_manifest(dir_fd, content).files):
            fd = open_regular(name, dir_fd=dir_fd)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                while os.readv(fd, [buf]) > 0:
                    if stop is not None and stop.is_set():
                        break
            finally:
                os.close(fd)
    return time.monotonic() - started


@dataclass
class Pace:
    """Reads no faster than ``rate`` bytes per second on average (0: as fast as it can)."""

    rate: float
    stop: Any = None
    started: float = field(default_factory=time.monotonic)
    done: int = 0

    def read(self, n: int) -> None:
        self.done += n
        if self.rate > 0:
            ahead = self.done / self.rate - (time.monotonic() - self.started)
            if ahead > 0:
                if self.stop is not None:
                    self.stop.wait(ahead)
                else:
                    time.sleep(ahead)


def verify_copy(root: Path, content: str, pace: Pace) -> str:
    """Read every chunk of the copy back and check it against its manifest; "" when all
    match, else the file and chunk that did not (or why the copy could not be read). Holds
    the content's lock shared, so it is not removed meanwhile."""
    own_dir(root / node_cache.PARTIAL)
    with digest_lock(node_cache.lock_file(root, content), shared=True):
        try:
            with open_dir(node_cache.copy_dir(root, content)) as dir_fd:
                manifest = _copy_manifest(dir_fd, content)
                for name, entry in sorted(manifest.files.items()):
                    if entry.digest is None:
                        return f"{content}/{name}: no chunk hashes (a schema-1 entry)"
                    why = _verify_file(dir_fd, name, entry.digest, pace)
                    if why:
                        return f"{content}/{name}: {why}"
                    if pace.stop is not None and pace.stop.is_set():
                        return ""
        except (OSError, ModelstageError) as e:
            return f"{content}: {_why(e)}"
    return ""


def _verify_file(dir_fd: int, name: str, want: FileDigest, pace: Pace) -> str:
    new_hash = blake3_module().blake3
    fd = open_regular(name, dir_fd=dir_fd)
    try:
        buf = memoryview(bytearray(min(want.chunk_bytes, WARM_BLOCK)))
        for index, expected in enumerate(want.chunks):
            begin, end = want.range(index)
            h, offset = new_hash(), begin
            while offset < end:
                n = os.preadv(fd, [buf[: min(len(buf), end - offset)]], offset)
                if n == 0:
                    return f"ends at byte {offset}, the manifest says {want.size}"
                h.update(buf[:n])
                offset += n
                pace.read(n)
            if h.hexdigest() != expected:
                return f"chunk {index} (bytes {begin}-{end - 1}) does not match its hash"
    finally:
        os.close(fd)
    return ""
