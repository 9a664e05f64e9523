"""Conditions the Kubernetes way (``operator/conditions.py``): one per type, in a fixed order,
``lastTransitionTime`` moves only when ``status`` changes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st
from modelstage.api.modeldeployment import Condition
from modelstage.operator.conditions import ORDER, condition, merge_conditions

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def test_condition_carries_every_field() -> None:
    c = condition("Staged", "True", "Staged", "artifact abc staged", now=T0, generation=3)
    assert (c.type, c.status, c.reason, c.message) == (
        "Staged",
        "True",
        "Staged",
        "artifact abc staged",
    )
    assert c.last_transition_time == T0 and c.observed_generation == 3


def test_a_new_message_or_reason_alone_keeps_the_transition_time() -> None:
    old = condition("Ready", "False", "RollingOut", "1 of 2 updated", now=T0, generation=1)
    new = condition("Ready", "False", "Stalled", "0 of 2 available", now=T1, generation=2)
    [merged] = merge_conditions([old], [new])
    assert merged.last_transition_time == T0
    assert (merged.reason, merged.message, merged.observed_generation) == (
        "Stalled",
        "0 of 2 available",
        2,
    )


def test_a_status_change_moves_the_transition_time() -> None:
    old = condition("Ready", "False", "RollingOut", "", now=T0)
    new = condition("Ready", "True", "Ready", "2 of 2 available", now=T1)
    assert merge_conditions([old], [new]) == [new]


def test_a_new_type_gets_its_own_time_and_untouched_types_stay() -> None:
    staged = condition("Staged", "True", "Staged", "done", now=T0)
    degraded = condition("Degraded", "False", "AsExpected", "", now=T0)
    ready = condition("Ready", "Unknown", "Pending", "", now=T1)
    assert merge_conditions([staged, degraded], [ready]) == [staged, ready, degraded]


def test_conditions_come_out_in_a_fixed_order_whatever_the_input_order() -> None:
    cs = [condition(t, "True", "R", "", now=T0) for t in reversed(ORDER)]
    order = ["Staged", "Ready", "Degraded", "NodeCached", "EngineCached"]
    assert [c.type for c in merge_conditions(cs, [])] == order
    assert [c.type for c in merge_conditions([], cs)] == order


def test_of_two_updates_of_one_type_the_last_wins_and_keeps_the_first_unchanged_time() -> None:
    old = condition("Staged", "False", "Staging", "", now=T0)
    first = condition("Staged", "False", "Queued", "position 1", now=T1)
    second = condition("Staged", "False", "Staging", "job running", now=T1 + timedelta(1))
    [merged] = merge_conditions([old], [first, second])
    assert (merged.reason, merged.message, merged.last_transition_time) == (
        "Staging",
        "job running",
        T0,
    )


def test_inputs_are_not_changed() -> None:
    old = condition("Ready", "False", "RollingOut", "", now=T0)
    new = condition("Ready", "False", "Stalled", "", now=T1)
    merge_conditions([old], [new])
    assert new.last_transition_time == T1 and old.reason == "RollingOut"


statuses = st.sampled_from(["True", "False", "Unknown"])
conditions = st.builds(
    lambda t, s, minutes: condition(t, s, "R", "", now=T0 + timedelta(minutes=minutes)),
    st.sampled_from(ORDER), statuses, st.integers(0, 100),
)  # fmt: skip


@given(current=st.lists(conditions, max_size=4), updates=st.lists(conditions, max_size=4))
def test_merging_is_per_type_and_times_move_only_on_status_changes(
    current: list[Condition], updates: list[Condition]
) -> None:
    merged = merge_conditions(current, updates)
    by_type = {c.type: c for c in merged}
    assert len(by_type) == len(merged) and [c.type for c in merged] == [
        t for t in ORDER if t in by_type
    ]
    last_current = {c.type: c for c in current}
    for type_, c in by_type.items():
        ups = [u for u in updates if u.type == type_]
        if not ups:
            assert c == last_current[type_]
            continue
        # the time is the first of the trailing run of equal statuses, starting from current
        chain = ([last_current[type_]] if type_ in last_current else []) + ups
        start = len(chain) - 1
        while start > 0 and chain[start - 1].status == chain[-1].status:
            start -= 1
        assert (
            c.status == ups[-1].status
            and c.last_transition_time == chain[start].last_transition_time
        )
    assert merge_conditions(merged, merged) == merged, (
        "merging a status with itself changes nothing"
    )
