"""What the node agent deletes to keep its root within the budget: a pure planner over the
root's scan and what the NodeCache's spec pins.

Least recently used first until the bytes held fit the budget, then back: a copy evicted on
the way that fits again once the later ones are gone is kept (most recently used first), so
no copy is evicted that could have stayed. Pinned copies (granted to a (namespace, digest) in
the spec's ``keep``) are never evicted, nor a partial copy being received; abandoned partial
copies of unpinned contents go first (no copy Job will resume them), those of pinned contents
last (a retry would resume them). When what is left still exceeds the budget, the plan says so
(the NodeCache's ``message``).

An offer makes room the same way (``plan_room``): the least set that lets its bytes fit both
the budget and the filesystem's free space is evicted first, or, when even evicting every
unpinned, idle copy would not make room, nothing is and the offer is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

_OLDEST = datetime.min.replace(tzinfo=UTC)


@dataclass(frozen=True)
class HeldCopy:
    content: str
    bytes: int
    last_used: datetime | None = None
    """None: never recorded, the first to go."""
    pinned: bool = False


@dataclass(frozen=True)
class PartialCopy:
    content: str
    bytes: int
    locked: bool
    """Being received now: never removed."""
    pinned: bool = False


@dataclass(frozen=True)
class EvictionPlan:
    evict: tuple[str, ...] = ()
    """Complete copies to remove, least recently used first."""
    drop_partials: tuple[str, ...] = ()
    """Abandoned partial copies to remove."""
    bytes_after: int = 0
    message: str = ""
    """Why the budget is still exceeded, when it is."""


def _candidates(held: list[HeldCopy], partials: list[PartialCopy]) -> list[tuple[bool, str, int]]:
    """(is a copy, content, bytes) of everything removable, in the order it goes."""
    abandoned = sorted((p for p in partials if not p.locked), key=lambda p: p.content)
    lru = sorted(
        (c for c in held if not c.pinned), key=lambda c: (c.last_used or _OLDEST, c.content)
    )
    return (
        [(False, p.content, p.bytes) for p in abandoned if not p.pinned]
        + [(True, c.content, c.bytes) for c in lru]
        + [(False, p.content, p.bytes) for p in abandoned if p.pinned]
    )


def plan_eviction(
    held: Iterable[HeldCopy], partials: Iterable[PartialCopy], budget: int
) -> EvictionPlan:
    """What to delete so that the bytes held (complete and partial copies) fit ``budget``."""
    held, partials = list(held), list(partials)
    total = sum(c.bytes for c in held) + sum(p.bytes for p in partials)
    chosen: list[tuple[bool, str, int]] = []
    for candidate in _candidates(held, partials):
        if total <= budget:
            break
        chosen.append(candidate)
        total -= candidate[2]
    if total <= budget and chosen:
        for candidate in reversed(chosen[:-1]):  # the last one was needed: keep what fits
            if total + candidate[2] <= budget:
                chosen.remove(candidate)
                total += candidate[2]
    message = ""
    if total > budget:
        kept = sorted({c.content for c in held if c.pinned} | {p.content for p in partials})
        message = (
            f"over budget: {total} bytes held, budget {budget}; everything left is kept by the "
            f"NodeCache's spec or being copied ({', '.join(kept) or 'nothing'})"
        )
    evict = tuple(content for is_copy, content, _ in chosen if is_copy)
    drop = tuple(content for is_copy, content, _ in chosen if not is_copy)
    return EvictionPlan(evict, drop, total, message)


@dataclass(frozen=True)
class RoomPlan:
    """What an offer evicts before it reserves ``need`` bytes, or why it cannot."""

    eviction: EvictionPlan
    fits: bool
    held: int
    """Bytes held before any eviction."""
    evictable: int
    """Bytes that evicting every unpinned, idle copy and abandoned partial would free."""


def plan_room(
    held: Iterable[HeldCopy],
    partials: Iterable[PartialCopy],
    budget: int,
    free: int,
    need: int,
) -> RoomPlan:
    """The least eviction after which ``need`` more bytes fit ``budget`` (bytes held plus
    ``need``) and the filesystem's ``free`` bytes (plus what eviction frees). Both are bounds
    on what may stay held, so the eviction planner answers it under the tighter one; when even
    that leaves too much, nothing is evicted (an offer that cannot fit takes no copy with it).
    ``held`` copies being received or offered come marked ``pinned``, partials being written
    ``locked``."""
    held, partials = list(held), list(partials)
    total = sum(c.bytes for c in held) + sum(p.bytes for p in partials)
    target = min(budget - need, total + free - need)
    everything = plan_eviction(held, partials, -1)
    evictable = total - everything.bytes_after
    if everything.bytes_after > target:
        return RoomPlan(EvictionPlan(bytes_after=total), False, total, evictable)
    return RoomPlan(plan_eviction(held, partials, target), True, total, evictable)
