"""Conditions the Kubernetes way: one per type, ``lastTransitionTime`` moves only on a change
of ``status`` (a new message or reason alone does not count as a transition)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Literal

from modelstage.api.modeldeployment import Condition, ConditionType

Status = Literal["True", "False", "Unknown"]
ORDER: tuple[ConditionType, ...] = ("Staged", "Ready", "Degraded", "NodeCached", "EngineCached")


def condition(
    type_: ConditionType,
    status: Status,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int | None = None,
) -> Condition:
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=now,
        observed_generation=generation,
    )


def merge_conditions(current: Iterable[Condition], updates: Iterable[Condition]) -> list[Condition]:
    """``current`` with ``updates`` applied, keeping transition times of unchanged statuses;
    sorted in a fixed order so that equal inputs give equal status documents."""
    merged = {c.type: c for c in current}
    for new in updates:
        old = merged.get(new.type)
        if old is not None and old.status == new.status:
            new = new.model_copy(update={"last_transition_time": old.last_transition_time})
        merged[new.type] = new
    return [merged[t] for t in ORDER if t in merged]
