"""At most K stage Jobs at once per operator; the rest wait first come, first served."""

from __future__ import annotations

from modelstage.operator.slots import StagerSlots


def test_jobs_beyond_the_limit_wait_in_arrival_order() -> None:
    slots = StagerSlots(2)
    assert slots.acquire(("ns", "job-a"), ("ns", "a")) == 0
    assert slots.acquire(("ns", "job-b"), ("ns", "b")) == 0
    assert slots.acquire(("ns", "job-c"), ("ns", "c")) == 1
    assert slots.acquire(("ns", "job-d"), ("ns", "d")) == 2
    assert slots.acquire(("ns", "job-c"), ("ns", "c")) == 1, "asking again keeps the place"
    assert slots.waiting() == [("ns", "c"), ("ns", "d")]


def test_a_freed_slot_goes_to_the_head_of_the_queue_not_to_a_newcomer() -> None:
    slots = StagerSlots(1)
    assert slots.acquire(("ns", "job-a"), ("ns", "a")) == 0
    assert slots.acquire(("ns", "job-b"), ("ns", "b")) == 1
    assert slots.acquire(("ns", "job-c"), ("ns", "c")) == 2
    assert slots.finished(("ns", "job-a"))
    assert slots.acquire(("ns", "job-c"), ("ns", "c")) == 2, "c is behind b"
    assert slots.acquire(("ns", "job-b"), ("ns", "b")) == 0
    assert slots.acquire(("ns", "job-c"), ("ns", "c")) == 1


def test_a_reserved_job_is_admitted_again_and_finishing_twice_frees_once() -> None:
    slots = StagerSlots(1)
    assert slots.acquire(("ns", "job-a"), ("ns", "a")) == 0
    assert slots.acquire(("ns", "job-a"), ("ns", "a")) == 0  # a retry after a write conflict
    assert slots.finished(("ns", "job-a")) and not slots.finished(("ns", "job-a"))


def test_jobs_seen_running_at_startup_count_against_the_limit() -> None:
    slots = StagerSlots(1)
    slots.running(("ns", "job-old"))
    assert slots.acquire(("ns", "job-a"), ("ns", "a")) == 1


def test_a_deleted_model_deployment_leaves_the_queue() -> None:
    slots = StagerSlots(1)
    slots.acquire(("ns", "job-a"), ("ns", "a"))
    slots.acquire(("ns", "job-b"), ("ns", "b"))
    slots.acquire(("ns", "job-c"), ("ns", "c"))
    slots.forget(("ns", "b"))
    assert slots.acquire(("ns", "job-c"), ("ns", "c")) == 1


def test_zero_means_no_limit() -> None:
    slots = StagerSlots(0)
    assert all(slots.acquire(("ns", f"j{i}"), ("ns", f"m{i}")) == 0 for i in range(50))


def test_one_namespace_cannot_take_every_slot() -> None:
    slots = StagerSlots(4, per_namespace=2)
    assert slots.acquire(("greedy", "job-1"), ("greedy", "m1")) == 0
    assert slots.acquire(("greedy", "job-2"), ("greedy", "m2")) == 0
    assert slots.acquire(("greedy", "job-3"), ("greedy", "m3")) == 1, "at its cap"
    assert slots.acquire(("greedy", "job-4"), ("greedy", "m4")) == 2
    # Another namespace passes the capped waiters: they wait for their own Jobs, not a slot.
    assert slots.acquire(("team", "job-a"), ("team", "a")) == 0
    assert slots.finished(("greedy", "job-1"))
    assert slots.acquire(("greedy", "job-4"), ("greedy", "m4")) == 2, "m3 is ahead"
    assert slots.acquire(("greedy", "job-3"), ("greedy", "m3")) == 0


def test_jobs_seen_running_count_against_their_namespaces_cap() -> None:
    slots = StagerSlots(0, per_namespace=1)
    slots.running(("ns", "job-old"))
    assert slots.acquire(("ns", "job-a"), ("ns", "a")) == 1
    assert slots.acquire(("other", "job-b"), ("other", "b")) == 0, "no global limit"
    assert slots.finished(("ns", "job-old"))
    assert slots.acquire(("ns", "job-a"), ("ns", "a")) == 0
