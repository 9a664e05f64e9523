"""What the node agent deletes, and what it must keep: pure functions over the root's scan and
the ModelDeployments' bodies.

- ``pinned_digests``: every digest some ModelDeployment serves, keeps for rollback, is rolling
  out or copying to nodes, and the newest ``spec.retention.keep`` of its history. Read from the
  raw bodies (any namespace, any status the operator wrote), so a field this agent does not
  know never stops it from pinning what it does know.
- ``plan_eviction``: least recently used first, until the bytes held fit the budget. Pinned
  copies are never evicted, nor a partial copy a copier holds the lock of; abandoned partial
  copies of unpinned digests go first (no copy Job will resume them), those of pinned digests
  last (a retry would resume them). When what is left still exceeds the budget, the plan says
  so (the NodeCache's ``message``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from modelstage.core.digest import DIGEST_HEX_CHARS
from modelstage.core.node_cache import WARMING

DEFAULT_KEEP = 2
"""``spec.retention.keep`` when a ModelDeployment does not set it (the CRD's default)."""
_DIGEST = re.compile(rf"^[0-9a-f]{{{DIGEST_HEX_CHARS}}}$")
_OLDEST = datetime.min.replace(tzinfo=UTC)


@dataclass(frozen=True)
class HeldCopy:
    digest: str
    bytes: int
    last_used: datetime | None = None
    """None: never recorded, the first to go."""
    pinned: bool = False


@dataclass(frozen=True)
class PartialCopy:
    digest: str
    bytes: int
    locked: bool
    """A copier holds its lock: being written now, never removed."""
    pinned: bool = False


@dataclass(frozen=True)
class EvictionPlan:
    evict: tuple[str, ...] = ()
    """Complete copies to remove, in this order."""
    drop_partials: tuple[str, ...] = ()
    """Abandoned partial copies to remove."""
    bytes_after: int = 0
    message: str = ""
    """Why the budget is still exceeded, when it is."""


def _digest(value: Any) -> str | None:
    return value if isinstance(value, str) and _DIGEST.fullmatch(value) else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _keep(spec: Mapping[str, Any]) -> int:
    keep = _mapping(spec.get("retention")).get("keep", DEFAULT_KEEP)
    return keep if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0 else 0


def pins_of(body: Mapping[str, Any]) -> set[str]:
    """The digests one ModelDeployment needs on the nodes."""
    status = _mapping(body.get("status"))
    found = {
        _digest(_mapping(status.get("artifact")).get("digest")),
        _digest(_mapping(status.get("previousArtifact")).get("digest")),
        _digest(status.get("desiredDigest")),
        _digest(_mapping(status.get("nodeCache")).get("digest")),
    }
    history = status.get("artifacts")
    if isinstance(history, list):
        keep = _keep(_mapping(body.get("spec")))
        found |= {_digest(_mapping(a).get("digest")) for a in history[:keep]}
    return {d for d in found if d is not None}


def pinned_digests(bodies: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """Every digest some ModelDeployment pins (``pins_of``)."""
    pinned: set[str] = set()
    for body in bodies:
        pinned |= pins_of(body)
    return frozenset(pinned)


def warm_requests(bodies: Iterable[Mapping[str, Any]], node: str) -> frozenset[str]:
    """Digests that a ModelDeployment in its ``Warming`` phase wants read into this node's
    page cache (this node among its ``status.nodeCache.nodes``)."""
    wanted: set[str] = set()
    for body in bodies:
        cache = _mapping(_mapping(body.get("status")).get("nodeCache"))
        digest = _digest(cache.get("digest"))
        nodes = cache.get("nodes")
        if cache.get("phase") != WARMING or digest is None or not isinstance(nodes, list):
            continue
        if any(_mapping(n).get("name") == node for n in nodes):
            wanted.add(digest)
    return frozenset(wanted)


def plan_eviction(
    held: Iterable[HeldCopy], partials: Iterable[PartialCopy], budget: int
) -> EvictionPlan:
    """What to delete so that the bytes held (complete and partial copies) fit ``budget``."""
    held, partials = list(held), list(partials)
    total = sum(c.bytes for c in held) + sum(p.bytes for p in partials)
    candidates: list[tuple[str, str, int]] = []  # (kind, digest, bytes) in eviction order
    abandoned = [p for p in partials if not p.locked]
    candidates += [("partial", p.digest, p.bytes) for p in sorted(abandoned, key=_by_digest)
                   if not p.pinned]  # fmt: skip
    lru = sorted(
        (c for c in held if not c.pinned), key=lambda c: (c.last_used or _OLDEST, c.digest)
    )
    candidates += [("copy", c.digest, c.bytes) for c in lru]
    candidates += [("partial", p.digest, p.bytes) for p in sorted(abandoned, key=_by_digest)
                   if p.pinned]  # fmt: skip
    evict: list[str] = []
    drop: list[str] = []
    for kind, digest, size in candidates:
        if total <= budget:
            break
        (evict if kind == "copy" else drop).append(digest)
        total -= size
    message = ""
    if total > budget:
        kept = sorted({c.digest for c in held if c.pinned} | {p.digest for p in partials})
        message = (
            f"over budget: {total} bytes held, budget {budget}; everything left is pinned by a "
            f"ModelDeployment or being copied ({', '.join(kept) or 'nothing'})"
        )
    return EvictionPlan(tuple(evict), tuple(drop), total, message)


def _by_digest(p: PartialCopy) -> str:
    return p.digest
