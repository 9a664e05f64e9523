"""The agent's pure decisions: what is pinned, what to warm, what to evict under the budget
(least recently used first, never pinned, never a copy being written), and the label patch
of its own node (only the cache's labels)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from modelstage.agent.agent import label_patch
from modelstage.agent.eviction import (
    HeldCopy,
    PartialCopy,
    pinned_digests,
    pins_of,
    plan_eviction,
    warm_requests,
)
from modelstage.core.node_cache import LABEL_PREFIX, node_label
from support.node_agent import fake_digest

A, B, C, D, E, F = (fake_digest(i) for i in range(1, 7))
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


def md(status: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "m", "namespace": "n"}, "spec": spec or {}, "status": status}


@pytest.mark.parametrize(
    "status",
    [
        {"artifact": {"digest": A}},
        {"previousArtifact": {"digest": A}},
        {"desiredDigest": A},
        {"nodeCache": {"digest": A, "phase": "Copying"}},
        {"artifacts": [{"digest": A}]},
    ],
    ids=["served", "previous", "desired", "node-cache", "history"],
)
def test_each_kind_of_use_pins(status: dict[str, Any]) -> None:
    assert pins_of(md(status)) == {A}


def test_history_pins_only_the_kept_ones() -> None:
    history = [{"digest": d} for d in (A, B, C, D)]
    assert pins_of(md({"artifacts": history})) == {A, B}  # retention.keep defaults to 2
    assert pins_of(md({"artifacts": history}, {"retention": {"keep": 3}})) == {A, B, C}


def test_pins_ignore_what_is_not_a_digest() -> None:
    bodies = [
        md({"artifact": {"digest": "../etc"}, "desiredDigest": 7, "artifacts": "x"}),
        md({"artifact": None, "nodeCache": []}),
        {"metadata": {}},
        md({"previousArtifact": {"digest": B}}),
    ]
    assert pinned_digests(bodies) == frozenset({B})


def test_warm_requests_are_this_nodes_warming_digests() -> None:
    def warming(digest: str, phase: str, *nodes: str) -> dict[str, Any]:
        cache = {"digest": digest, "phase": phase, "nodes": [{"name": n} for n in nodes]}
        return md({"nodeCache": cache})

    bodies = [warming(A, "Warming", "n1", "n2"), warming(B, "Warming", "n2"),
              warming(C, "Ready", "n1"), warming("bad", "Warming", "n1")]  # fmt: skip
    assert warm_requests(bodies, "n1") == frozenset({A})
    assert warm_requests(bodies, "n2") == frozenset({A, B})


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


def test_label_patch_touches_only_the_cache_labels() -> None:
    current = {"kubernetes.io/hostname": "n1", "team": "a", node_label(A): "true",
               node_label(B): "true", LABEL_PREFIX + "junk": "x"}  # fmt: skip
    patch = label_patch(current, [B, C])
    assert patch == {node_label(C): "true", node_label(A): None, LABEL_PREFIX + "junk": None}
    assert label_patch({node_label(A): "true"}, [A]) == {}


copies = st.lists(
    st.builds(HeldCopy, digest=st.sampled_from([fake_digest(i) for i in range(40)]),
              bytes=st.integers(0, 100), last_used=st.none() | st.integers(0, 50).map(at),
              pinned=st.booleans()),
    max_size=12, unique_by=lambda c: c.digest,
)  # fmt: skip
partial_copies = st.lists(
    st.builds(PartialCopy, digest=st.sampled_from([fake_digest(i) for i in range(40, 60)]),
              bytes=st.integers(0, 100), locked=st.booleans(), pinned=st.booleans()),
    max_size=5, unique_by=lambda p: p.digest,
)  # fmt: skip


@given(held=copies, partials=partial_copies, budget=st.integers(0, 800))
def test_eviction_properties(
    held: list[HeldCopy], partials: list[PartialCopy], budget: int
) -> None:
    plan = plan_eviction(held, partials, budget)
    by_digest = {c.digest: c for c in held}
    by_partial = {p.digest: p for p in partials}
    assert not any(by_digest[d].pinned for d in plan.evict)  # never a pinned copy
    assert not any(by_partial[d].locked for d in plan.drop_partials)  # never one being written
    left = [c for c in held if c.digest not in plan.evict]
    left_partials = [p for p in partials if p.digest not in plan.drop_partials]
    assert plan.bytes_after == sum(c.bytes for c in left) + sum(p.bytes for p in left_partials)
    assert (plan.bytes_after > budget) == bool(plan.message)
    if plan.message:  # over budget only when nothing more could go
        assert all(c.pinned for c in left) and all(p.locked for p in left_partials)
    oldest = datetime.min.replace(tzinfo=UTC)
    evicted = [by_digest[d] for d in plan.evict]
    for kept in (c for c in left if not c.pinned):  # least recently used first
        assert all((e.last_used or oldest) <= (kept.last_used or oldest) for e in evicted)
    total = sum(c.bytes for c in held) + sum(p.bytes for p in partials)
    if total <= budget:
        assert plan.evict == () and plan.drop_partials == ()
