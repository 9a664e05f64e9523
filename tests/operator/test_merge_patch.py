"""JSON merge patches (RFC 7386): diff then apply reproduces the target; applying is idempotent."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modelstage.operator.patch import apply_merge_patch, merge_diff

# The CI machine is small and shared: no per-example deadline, generation may be slow.
RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
scalars = st.one_of(st.booleans(), st.integers(), st.text(max_size=3))
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("abcde"), inner, max_size=4)
    ),
    max_leaves=10,
)
objects = st.dictionaries(st.sampled_from("abcde"), documents, max_size=5)


@RELAXED
@given(old=objects, new=objects)
def test_applying_the_diff_yields_the_new_document(
    old: dict[str, Any], new: dict[str, Any]
) -> None:
    assert apply_merge_patch(old, merge_diff(old, new)) == new


@RELAXED
@given(old=objects, new=objects)
def test_applying_a_diff_twice_changes_nothing_more(
    old: dict[str, Any], new: dict[str, Any]
) -> None:
    patch = merge_diff(old, new)
    once = apply_merge_patch(old, patch)
    assert apply_merge_patch(once, patch) == once
    assert merge_diff(once, new) == {}


def test_rfc7386_examples() -> None:
    target = {"a": "b", "c": {"d": "e", "f": "g"}}
    assert apply_merge_patch(target, {"a": "z", "c": {"f": None}}) == {"a": "z", "c": {"d": "e"}}
    assert apply_merge_patch({"a": [{"b": "c"}]}, {"a": [1]}) == {"a": [1]}
    assert apply_merge_patch({"a": "b"}, {"b": None}) == {"a": "b"}


def test_diff_of_equal_documents_is_empty_and_does_not_alias() -> None:
    doc = {"spec": {"template": {"spec": {"containers": [{"name": "x"}]}}}}
    assert merge_diff(doc, doc) == {}
    new = {"spec": {"template": {"spec": {"containers": [{"name": "y"}]}}}}
    patch = merge_diff(doc, new)
    patch["spec"]["template"]["spec"]["containers"][0]["name"] = "mutated"
    assert new["spec"]["template"]["spec"]["containers"][0]["name"] == "y"
