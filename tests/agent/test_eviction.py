"""The agent's pure decisions: what to evict under the budget (least recently used first,
never a pinned copy or one being written, none that could have stayed), which copies a
NodeCache's (namespace, digest) pairs name, and the label patch of its own node (only the
cache's opaque labels)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st
from modelstage.agent.agent import contents_for, label_patch
from modelstage.agent.eviction import HeldCopy, PartialCopy, plan_eviction, plan_room
from modelstage.agent.store import Copy
from modelstage.api.nodecache import Grant
from modelstage.core.node_cache import LABEL_PREFIX, content_label
from support.node_agent import fake_digest


def content(i: int) -> str:
    return f"{i:02x}" * 16


A, B, C, D, E, F = (content(i) for i in range(1, 7))
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


def test_under_budget_nothing_goes() -> None:
    plan = plan_eviction([HeldCopy(A, 10, at(0))], [PartialCopy(B, 5, locked=False)], 15)
    assert (plan.evict, plan.drop_partials, plan.bytes_after, plan.message) == ((), (), 15, "")


def test_least_recently_used_first_until_it_fits() -> None:
    held = [HeldCopy(A, 10, at(3)), HeldCopy(B, 10, at(1)), HeldCopy(C, 10, at(2)),
            HeldCopy(D, 10, None)]  # fmt: skip
    plan = plan_eviction(held, [], 20)
    assert plan.evict == (D, B) and plan.bytes_after == 20 and plan.message == ""


def test_pinned_copies_are_never_evicted_and_the_plan_says_why() -> None:
    held = [HeldCopy(A, 10, None, pinned=True), HeldCopy(B, 10, at(5)),
            HeldCopy(C, 10, at(0), pinned=True)]  # fmt: skip
    plan = plan_eviction(held, [], 5)
    assert plan.evict == (B,)
    assert plan.bytes_after == 20
    assert plan.message.startswith("over budget: 20 bytes held, budget 5; everything left is")
    assert A in plan.message and C in plan.message


def test_abandoned_partials_go_first_and_locked_ones_never() -> None:
    held = [HeldCopy(A, 10, at(0))]
    partials = [PartialCopy(B, 4, locked=True), PartialCopy(C, 3, locked=False),
                PartialCopy(D, 3, locked=False, pinned=True)]  # fmt: skip
    assert plan_eviction(held, partials, 17).drop_partials == (C,)
    plan = plan_eviction(held, partials, 4)
    assert plan.drop_partials == (C, D) and plan.evict == (A,) and plan.bytes_after == 4
    plan = plan_eviction(held, partials, 0)
    assert B not in plan.drop_partials and B in plan.message


def test_a_pinned_partial_goes_after_every_unpinned_copy() -> None:
    plan = plan_eviction([HeldCopy(A, 10, at(0))], [PartialCopy(D, 3, False, pinned=True)], 3)
    assert plan.evict == (A,) and plan.drop_partials == ()


def test_a_small_copy_evicted_on_the_way_stays_when_it_fits_again() -> None:
    """The oldest copy is small: evicting it was not enough, the next one was; with that one
    gone the small one fits again, so it stays."""
    plan = plan_eviction([HeldCopy(A, 1, at(0)), HeldCopy(B, 100, at(1))], [], 10)
    assert plan.evict == (B,) and plan.bytes_after == 1


def test_label_patch_touches_only_the_cache_labels() -> None:
    current = {"kubernetes.io/hostname": "n1", "team": "a", content_label(A): "true",
               content_label(B): "true", LABEL_PREFIX + "junk": "x"}  # fmt: skip
    patch = label_patch(current, [B, C])
    assert patch == {content_label(C): "true", content_label(A): None, LABEL_PREFIX + "junk": None}
    assert label_patch({content_label(A): "true"}, [A]) == {}


def test_labels_name_no_digest_nor_content() -> None:
    label = content_label(A)
    assert label.startswith(LABEL_PREFIX) and A not in label and A[:20] not in label
    assert len(label.removeprefix(LABEL_PREFIX)) == 20 and content_label(B) != label


def test_the_spec_pairs_name_the_copies_granted_to_them() -> None:
    copies = [Copy(A, 1, 1, {"grants": [{"namespace": "a", "digest": fake_digest(1)}]}),
              Copy(B, 1, 1, {"grants": [{"namespace": "b", "digest": fake_digest(1)},
                                        {"namespace": "a", "digest": fake_digest(2)}]}),
              Copy(C, 1, 1, {"grants": "junk"})]  # fmt: skip
    assert contents_for([Grant(namespace="a", digest=fake_digest(1))], copies) == {A}
    assert contents_for([Grant(namespace="a", digest=fake_digest(2))], copies) == {B}
    assert contents_for([Grant(namespace="c", digest=fake_digest(1))], copies) == frozenset()


copies = st.lists(
    st.builds(HeldCopy, content=st.sampled_from([content(i) for i in range(40)]),
              bytes=st.integers(0, 100), last_used=st.none() | st.integers(0, 50).map(at),
              pinned=st.booleans()),
    max_size=12, unique_by=lambda c: c.content,
)  # fmt: skip
partial_copies = st.lists(
    st.builds(PartialCopy, content=st.sampled_from([content(i) for i in range(40, 60)]),
              bytes=st.integers(0, 100), locked=st.booleans(), pinned=st.booleans()),
    max_size=5, unique_by=lambda p: p.content,
)  # fmt: skip


@given(held=copies, partials=partial_copies, budget=st.integers(0, 800))
def test_eviction_properties(
    held: list[HeldCopy], partials: list[PartialCopy], budget: int
) -> None:
    plan = plan_eviction(held, partials, budget)
    by_content = {c.content: c for c in held}
    by_partial = {p.content: p for p in partials}
    assert not any(by_content[d].pinned for d in plan.evict)  # never a pinned copy
    assert not any(by_partial[d].locked for d in plan.drop_partials)  # never one being written
    left = [c for c in held if c.content not in plan.evict]
    left_partials = [p for p in partials if p.content not in plan.drop_partials]
    assert plan.bytes_after == sum(c.bytes for c in left) + sum(p.bytes for p in left_partials)
    assert (plan.bytes_after > budget) == bool(plan.message)
    if plan.message:  # over budget only when nothing more could go
        assert all(c.pinned for c in left) and all(p.locked for p in left_partials)
    removed = [by_content[d].bytes for d in plan.evict]
    removed += [by_partial[d].bytes for d in plan.drop_partials]
    for size in removed:  # minimal: keeping any one of them leaves the root over budget
        assert plan.bytes_after + size > budget
    oldest = datetime.min.replace(tzinfo=UTC)
    evicted = [by_content[d] for d in plan.evict]
    assert [e.last_used or oldest for e in evicted] == sorted(e.last_used or oldest
                                                               for e in evicted)  # fmt: skip
    for kept in (c for c in left if not c.pinned):  # least recently used first: an older copy
        for e in evicted:  # kept over a newer one only because evicting it instead fell short
            if (kept.last_used or oldest) < (e.last_used or oldest):
                assert plan.bytes_after + e.bytes - kept.bytes > budget
    total = sum(c.bytes for c in held) + sum(p.bytes for p in partials)
    if total <= budget:
        assert plan.evict == () and plan.drop_partials == ()


def test_room_for_an_offer_evicts_the_oldest_unpinned_copy_only() -> None:
    held = [HeldCopy(A, 10, at(0), pinned=True), HeldCopy(B, 10, at(1)), HeldCopy(C, 10, at(2))]
    room = plan_room(held, [], budget=30, free=100, need=10)
    assert room.fits and room.eviction.evict == (B,) and room.evictable == 20


def test_room_that_cannot_be_made_evicts_nothing() -> None:
    held = [HeldCopy(A, 10, at(0), pinned=True), HeldCopy(B, 10, at(1))]
    room = plan_room(held, [PartialCopy(C, 5, locked=True)], budget=24, free=100, need=10)
    assert not room.fits and room.eviction.evict == () and room.eviction.drop_partials == ()
    assert (room.held, room.evictable) == (25, 10)


def test_room_counts_the_filesystem_free_space_too() -> None:
    """Within budget but the disk is short: eviction frees the disk as well."""
    held = [HeldCopy(A, 10, at(0)), HeldCopy(B, 10, at(1))]
    room = plan_room(held, [], budget=1000, free=5, need=12)
    assert room.fits and room.eviction.evict == (A,)


@given(held=copies, partials=partial_copies, budget=st.integers(0, 800),
       free=st.integers(0, 800), need=st.integers(0, 300))  # fmt: skip
def test_room_properties(
    held: list[HeldCopy], partials: list[PartialCopy], budget: int, free: int, need: int
) -> None:
    room = plan_room(held, partials, budget, free, need)
    plan = room.eviction
    by_content = {c.content: c for c in held}
    by_partial = {p.content: p for p in partials}
    total = sum(c.bytes for c in held) + sum(p.bytes for p in partials)
    movable = sum(c.bytes for c in held if not c.pinned)
    movable += sum(p.bytes for p in partials if not p.locked)
    assert room.held == total and room.evictable == movable

    def fits(after: int) -> bool:
        return after + need <= budget and need <= free + total - after

    assert room.fits == fits(total - movable)  # refused only when nothing could make room
    if not room.fits:
        assert plan.evict == () and plan.drop_partials == ()
        return
    assert fits(plan.bytes_after)
    assert not any(by_content[d].pinned for d in plan.evict)
    assert not any(by_partial[d].locked for d in plan.drop_partials)
    removed = [by_content[d].bytes for d in plan.evict]
    removed += [by_partial[d].bytes for d in plan.drop_partials]
    assert plan.bytes_after == total - sum(removed)
    for size in removed:  # minimal: keeping any one of them would not make room
        assert not fits(plan.bytes_after + size)
    oldest = datetime.min.replace(tzinfo=UTC)
    evicted = [by_content[d] for d in plan.evict]
    for kept in (c for c in held if not c.pinned and c.content not in plan.evict):
        for e in evicted:  # an older idle copy kept over a newer one only when it had to be
            if (kept.last_used or oldest) < (e.last_used or oldest):
                assert not fits(plan.bytes_after + e.bytes - kept.bytes)
    if fits(total):
        assert plan.evict == () and plan.drop_partials == ()
