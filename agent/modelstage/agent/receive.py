"""The agent's side of a copy: offers, files and commits, whatever carries them (``server.py``
serves them over HTTP).

1. An *offer* (a namespace's manifest and spec digest) is parsed with every limit, named by
   its content, and checked for room **before any byte**: its bytes against the budget less
   what the disk holds and what other offers reserved, against the filesystem's free space,
   and against the namespace's quota. Accepted, the bytes are reserved until the commit or
   ``OFFER_TTL`` seconds without a request.
2. Each *file* is read exactly to its declared size, every chunk hashed as it arrives; a
   mismatch removes what was written. A namespace's file counts as proven (kept in memory)
   once every chunk matched. When the copy is complete already, or the file was received
   and verified before, the bytes are verified and discarded: nothing is rewritten.
3. The *commit* of a namespace that proved every file: the canonical manifest written last,
   modes 0440/0550, one rename, then the grant (namespace, digest) recorded.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from modelstage.core import node_cache
from modelstage.core.durable import fsync_dir
from modelstage.core.errors import ModelstageError
from modelstage.core.integrity import FileDigest, blake3_module
from modelstage.core.manifest import MANIFEST, SCHEMA_VERSION, Manifest, check_ranks_present

from . import eviction, store
from .auth import Refused
from .locks import digest_lock, own_dir

OFFER_TTL = 600.0
"""Seconds an offer keeps its reservation without a request for its content."""
READ_BLOCK = 1024 * 1024
"""Bytes read from a stream at a time: memory per file received, whatever its chunk size."""
Read = Callable[[int], bytes]
"""``read(n)``: at most ``n`` bytes of the request body; fewer only at its end."""


@dataclass
class Offer:
    """A content being received (or proven): its manifest and the bytes reserved for it."""

    content: str
    manifest: Manifest
    canonical: bytes
    reserved: int
    started: float
    touched: float
    written: int = 0
    verified: set[str] = field(default_factory=set)
    """Files of ``.partial/<content>`` received and verified by this agent."""
    committed: bool = False
    """Published: its ``verified`` files are in the copy now, not in a partial one."""

    @property
    def outstanding(self) -> int:
        return max(0, self.reserved - self.written)


@dataclass
class Receiver:
    root: Path
    node: str
    budget: int
    namespace_quota: int = 0
    """Bytes of copies granted to one namespace on this node (0: no quota)."""
    on_commit: Callable[[], None] | None = None
    keep: Callable[[], frozenset[store.GrantKey] | None] | None = None
    """The (namespace, digest) pairs the NodeCache's spec keeps; None (or no callable): not
    known yet, so an offer evicts nothing."""
    refresh_keep: Callable[[], None] | None = None
    """Reads the spec again before an offer is refused for room: the operator lets a copy go
    (its ModelDeployment's history trimmed) as it creates the Job that needs the room, and
    the watch may not have brought that spec yet."""
    on_evict: Callable[[str], None] | None = None
    """Called with each copy an offer evicted (the agent counts it)."""
    clock: Callable[[], float] = time.monotonic
    offers: dict[str, Offer] = field(default_factory=dict)
    proofs: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """(namespace, content): the files that namespace streamed, every chunk matching."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def active(self) -> set[str]:
        """Contents with an offer in progress (their partial copies are not abandoned)."""
        now = self.clock()
        with self._lock:
            self.offers = {c: o for c, o in self.offers.items() if now - o.touched < OFFER_TTL}
            return set(self.offers)

    def offer(self, namespace: str, digest: str, body: bytes) -> dict[str, Any]:
        _checked(node_cache.check_digest, digest)
        manifest = parse_offer(body, digest)
        canonical = node_cache.canonical_manifest(body)
        content = node_cache.content_address(body)
        self.active()  # expired offers give their reservations back first
        with self._lock:
            complete, record = self._complete(content)
            granted = _holds(record, namespace)
            if not granted:
                self._check_quota(namespace, manifest.bytes + len(canonical))
            offer = self.offers.get(content)
            if offer is None or (offer.committed and not complete):  # evicted since: anew
                reserve = 0 if complete else self._check_room(content, manifest, canonical)
                if not complete:  # proofs of files this agent no longer holds: sent anew
                    self.proofs = {k: v for k, v in self.proofs.items() if k[1] != content}
                now = self.clock()
                offer = Offer(content, manifest, canonical, reserve, now, now)
                self.offers[content] = offer
            offer.touched = self.clock()
            proven = self.proofs.get((namespace, content), set())
        need = [] if granted else sorted(set(manifest.files) - proven)
        return {"content": content, "need": need, "complete": complete, "granted": granted,
                "node": self.node}  # fmt: skip

    def _complete(self, content: str) -> tuple[bool, dict[str, Any]]:
        try:
            with store.open_dir(node_cache.copy_dir(self.root, content)) as fd:
                manifest, _, _ = store.check_copy(fd, content)
        except (OSError, ModelstageError):
            return False, {}
        if manifest is None:
            return False, {}
        return True, store.read_record(self.root, content)

    def _check_room(self, content: str, manifest: Manifest, canonical: bytes) -> int:
        """The bytes to reserve for a new copy, after evicting the least recently used
        unpinned, idle copies it needs (``eviction.plan_room``), or a 507 naming the node and
        the numbers when even that would not make room (then nothing is evicted)."""
        scan = store.scan(self.root)
        present = sum(p.bytes for p in scan.partials if p.content == content)
        need = max(0, manifest.bytes + len(canonical) - present)
        reserved = sum(o.outstanding for o in self.offers.values())
        plan = eviction.plan_room(*self._evictable(scan, content), self.budget - reserved,
                                  _free(self.root) - reserved, need)  # fmt: skip
        if not plan.fits and self.refresh_keep is not None:
            self.refresh_keep()
            plan = eviction.plan_room(*self._evictable(scan, content), self.budget - reserved,
                                      _free(self.root) - reserved, need)  # fmt: skip
        if plan.fits and (plan.eviction.evict or plan.eviction.drop_partials):
            self._evict(plan.eviction)
            scan = store.scan(self.root)
        left = self.budget - scan.bytes - reserved
        also = f", {plan.evictable} of them evictable" if plan.evictable else ""  # not enough
        if need > left:
            raise Refused(507, (
                f"node {self.node}: the copy needs {need} bytes, the node cache's budget of "
                f"{self.budget} has {max(left, 0)} left ({scan.bytes} held{also}, {reserved} "
                "reserved by copies in progress); raise the budget or let copies be evicted"
            ))  # fmt: skip
        free = _free(self.root) - reserved
        if need > free:
            raise Refused(507, (
                f"node {self.node}: the copy needs {need} bytes, the node cache's filesystem "
                f"has {max(free, 0)} free ({reserved} reserved by copies in progress{also}); "
                "free disk space on the node or lower the budget"
            ))  # fmt: skip
        return need

    def _evictable(
        self, scan: store.Scan, content: str
    ) -> tuple[list[eviction.HeldCopy], list[eviction.PartialCopy]]:
        """The root's copies as the planner sees them at an offer: pinned when the spec keeps
        them, when an offer is in progress for them (not yet committed), or when the spec is
        not known (then nothing is evicted); partials locked when being received
        (``content``'s own too)."""
        keep = self.keep() if self.keep is not None else None
        busy = {c for c, o in self.offers.items() if not o.committed} | {content}
        held = [
            eviction.HeldCopy(c.content, c.bytes, store.record_time(c.record.get("lastUsed")),
                              keep is None or c.content in busy or bool(keep & set(c.grants)))
            for c in scan.copies
        ]  # fmt: skip
        partials = [
            eviction.PartialCopy(p.content, p.bytes, keep is None or p.content in busy
                                 or store.partial_locked(self.root, p.content))
            for p in scan.partials
        ]  # fmt: skip
        return held, partials

    def _evict(self, plan: eviction.EvictionPlan) -> None:
        for gone in plan.evict:
            if store.remove_copy(self.root, gone) and self.on_evict is not None:
                self.on_evict(gone)
        for gone in plan.drop_partials:
            store.remove_partial(self.root, gone)

    def _check_quota(self, namespace: str, size: int) -> None:
        if not self.namespace_quota:
            return
        scan = store.scan(self.root)
        used = sum(c.bytes for c in scan.copies if any(ns == namespace for ns, _ in c.grants))
        if used + size > self.namespace_quota:
            raise Refused(507, (
                f"node {self.node}: namespace {namespace} holds {used} bytes of copies here; "
                f"this one ({size}) would pass its quota of {self.namespace_quota} bytes "
                "(nodeCache.namespaceQuota); remove a ModelDeployment's node caching or raise "
                "the quota"
            ))  # fmt: skip

    def _offer(self, content: str) -> Offer:
        _checked(node_cache.check_content, content)
        with self._lock:
            offer = self.offers.get(content)
            if offer is None or self.clock() - offer.touched >= OFFER_TTL:
                raise Refused(404, (
                    f"no offer in progress for {content} on node {self.node}: offer the "
                    f"manifest first (offers end {OFFER_TTL:.0f} s after their last request)"
                ))  # fmt: skip
            offer.touched = self.clock()
            return offer

    def put_file(self, namespace: str, content: str, name: str, length: int, read: Read) -> None:
        """Receive one file of ``content``; proven for ``namespace`` once every chunk matched."""
        offer = self._offer(content)
        entry = offer.manifest.files.get(name)
        if entry is None or entry.digest is None:
            raise Refused(404, f"{name!r} is not a file of {content}'s manifest")
        if length != entry.size:
            raise Refused(400, (
                f"{name}: Content-Length {length}, the manifest says {entry.size} bytes; send "
                "exactly the file's bytes"
            ))  # fmt: skip
        lock = node_cache.lock_file(self.root, content)
        own_dir(self.root / node_cache.PARTIAL)
        with digest_lock(lock, shared=True):
            complete, _ = self._complete(content)
            if not complete and offer.committed:
                raise Refused(409, f"{content} was removed since it was offered: offer again")
            if complete or name in offer.verified:
                check_stream(name, entry.digest, read, None)
            else:
                self._receive(offer, name, entry.digest, read)
        with self._lock:
            self.proofs.setdefault((namespace, content), set()).add(name)
            offer.touched = self.clock()

    def _receive(self, offer: Offer, name: str, want: FileDigest, read: Read) -> None:
        partial = own_dir(node_cache.partial_dir(self.root, offer.content))
        os.chmod(partial, 0o700)
        with store.open_dir(partial) as dir_fd:
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            fd = os.open(tmp, _NEW_FILE, 0o600, dir_fd=dir_fd)
            try:
                check_stream(name, want, read, fd)
                os.fsync(fd)
                os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            finally:
                os.close(fd)
        with self._lock:
            offer.verified.add(name)
            offer.written += want.size

    def commit(self, namespace: str, content: str, digest: str) -> dict[str, Any]:
        _checked(node_cache.check_digest, digest)
        offer = self._offer(content)
        with self._lock:
            proven = self.proofs.get((namespace, content), set())
        missing = sorted(set(offer.manifest.files) - proven)
        if missing and self._complete(content)[0]:
            missing = [] if _holds(self._complete(content)[1], namespace) else missing
        if missing:
            raise Refused(409, (
                f"namespace {namespace} has not streamed {len(missing)} file(s) of {content}: "
                f"{', '.join(missing[:5])}; send them before the commit"
            ))  # fmt: skip
        own_dir(self.root / node_cache.PARTIAL)
        with digest_lock(node_cache.lock_file(self.root, content)):
            already, _ = self._complete(content)
            if not already and offer.committed:
                raise Refused(409, f"{content} was removed since it was offered: offer again")
            if not already:
                self._publish(offer)
            grant = {"namespace": namespace, "digest": digest}
            store.update_record(self.root, content, lambda r: _granted(r, grant, offer, already))
        with self._lock:
            offer.reserved = offer.written = 0
            offer.committed = True
        if self.on_commit is not None:
            self.on_commit()
        with store.open_dir(node_cache.copy_dir(self.root, content)) as fd:
            _, size, _ = store.check_copy(fd, content)
        return {"content": content, "bytes": size, "files": len(offer.manifest.files),
                "alreadyComplete": already}  # fmt: skip

    def _publish(self, offer: Offer) -> None:
        """``.partial/<content>`` made the complete copy: strays out, files 0440, the canonical
        manifest written last, one rename, the directory 0550, the parents synced."""
        missing = sorted(set(offer.manifest.files) - offer.verified)
        if missing:
            raise Refused(409, (
                f"{offer.content}: {', '.join(missing[:5])} not received by this agent "
                "(it restarted?); offer again and send them"
            ))  # fmt: skip
        partial = node_cache.partial_dir(self.root, offer.content)
        final = node_cache.copy_dir(self.root, offer.content)
        store.remove_tree(final)  # an incomplete leftover of a removal: never a complete copy
        with store.open_dir(partial) as fd:
            for entry in os.listdir(fd):
                if entry not in offer.manifest.files:
                    _remove_entry(fd, partial / entry, entry)
            for entry in offer.manifest.files:
                os.chmod(entry, 0o440, dir_fd=fd, follow_symlinks=False)
            tmp = f".{MANIFEST}.{secrets.token_hex(6)}.tmp"
            out = os.open(tmp, _NEW_FILE, 0o440, dir_fd=fd)
            try:
                _write_all(out, offer.canonical)
                os.fsync(out)
            finally:
                os.close(out)
            os.rename(tmp, MANIFEST, src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)
        os.rename(partial, final)
        os.chmod(final, 0o550)
        fsync_dir(partial.parent)
        fsync_dir(self.root)


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _free(root: Path) -> int:
    stats = os.statvfs(root)
    return stats.f_bavail * stats.f_frsize


def _remove_entry(dir_fd: int, path: Path, name: str) -> None:
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(name, dir_fd=dir_fd)


def _holds(record: dict[str, Any], namespace: str) -> bool:
    """Whether ``namespace`` proved possession of the record's content before (a grant)."""
    return any(ns == namespace for ns, _ in store.record_grants(record))


def _granted(record: dict[str, Any], grant: dict[str, str], offer: Offer, already: bool) -> None:
    now = datetime.now(UTC).isoformat()
    if not already:
        record |= {"bytes": offer.manifest.bytes + len(offer.canonical),
                   "files": len(offer.manifest.files), "copiedAt": now,
                   "copySeconds": round(time.monotonic() - offer.started, 3),
                   "lastVerified": now}  # fmt: skip
    record.setdefault("lastUsed", now)
    grants = [{"namespace": ns, "digest": d} for ns, d in store.record_grants(record)]
    record["grants"] = grants + ([grant] if grant not in grants else [])


def parse_offer(body: bytes, digest: str) -> Manifest:
    """The offered manifest with every limit checked, or a 400 saying what to do."""
    try:
        manifest = Manifest.from_json(body, "the offered manifest")
        if manifest.schemaVersion != SCHEMA_VERSION:
            raise Refused(400, (
                f"the offered manifest is schema {manifest.schemaVersion}, without chunk "
                "hashes: the agent verifies every chunk; restage with this release"
            ))  # fmt: skip
        manifest.check_expected("the offered manifest", digest=digest)
        check_ranks_present("the offered manifest", manifest)
        for name, entry in sorted(manifest.files.items()):
            if entry.digest is None or entry.digest.root != entry.blake3:
                raise Refused(400, (
                    f"the offered manifest: files.{name}: its blake3 is not the root of its "
                    "chunk hashes; the manifest is corrupt: restage"
                ))  # fmt: skip
    except ModelstageError as e:
        raise Refused(400, str(e)) from None
    return manifest


def _checked(check: Callable[[str], str], value: str) -> None:
    try:
        check(value)
    except ModelstageError as e:
        raise Refused(400, str(e)) from None


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while len(view):
        view = view[os.write(fd, view) :]


def _blocks(read: Read, size: int) -> Iterator[bytes]:
    """Exactly ``size`` bytes of the stream, never one more; a short stream is a 400."""
    done = 0
    while done < size:
        data = read(min(READ_BLOCK, size - done))
        if not data:
            raise Refused(400, f"the stream ended after {done} of its {size} bytes")
        done += len(data)
        yield data


def check_stream(name: str, want: FileDigest, read: Read, fd: int | None) -> None:
    """Hash each chunk of the stream as it arrives (written to ``fd`` when given); 422 at the
    first chunk that does not match the manifest."""
    new_hash = blake3_module().blake3
    offset = 0
    for index, expected in enumerate(want.chunks):
        begin, end = want.range(index)
        h = new_hash()
        for data in _blocks(read, end - begin):
            h.update(data)
            if fd is not None:
                _write_all(fd, data)
        if h.hexdigest() != expected:
            raise Refused(422, (
                f"{name}: chunk {index} (bytes {begin}-{end - 1}) does not match the "
                "manifest's hash; the artifact is corrupt or changed since it was staged: "
                "verify it (`modelstage verify`) and restage"
            ))  # fmt: skip
        offset = end
    assert offset == want.size
