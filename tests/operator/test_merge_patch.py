"""JSON merge patches (RFC 7386): every example of the RFC; the same results as an independent
implementation (the ``json-merge-patch`` package) on generated documents; diff then apply
reproduces the target; applying is idempotent.

The fake API server of the operator tests (``tests/support/kube_fake.py``) applies merge
patches with this module, so these tests are what makes that fake trustworthy.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import json_merge_patch
import pytest
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


RFC7386_APPENDIX_A = [
    # (original, patch, result), as JSON text exactly as the RFC's appendix A lists them
    ('{"a":"b"}', '{"a":"c"}', '{"a":"c"}'),
    ('{"a":"b"}', '{"b":"c"}', '{"a":"b","b":"c"}'),
    ('{"a":"b"}', '{"a":null}', "{}"),
    ('{"a":"b","b":"c"}', '{"a":null}', '{"b":"c"}'),
    ('{"a":["b"]}', '{"a":"c"}', '{"a":"c"}'),
    ('{"a":"c"}', '{"a":["b"]}', '{"a":["b"]}'),
    ('{"a":{"b":"c"}}', '{"a":{"b":"d","c":null}}', '{"a":{"b":"d"}}'),
    ('{"a":[{"b":"c"}]}', '{"a":[1]}', '{"a":[1]}'),
    ('["a","b"]', '["c","d"]', '["c","d"]'),
    ('{"a":"b"}', '["c"]', '["c"]'),
    ('{"a":"foo"}', "null", "null"),
    ('{"a":"foo"}', '"bar"', '"bar"'),
    ('{"e":null}', '{"a":1}', '{"e":null,"a":1}'),
    ("[1,2]", '{"a":"b","c":null}', '{"a":"b"}'),
    ("{}", '{"a":{"bb":{"ccc":null}}}', '{"a":{"bb":{}}}'),
]
RFC7386_SECTION_3 = (
    '{"title":"Goodbye!","author":{"givenName":"John","familyName":"Doe"},'
    '"tags":["example","sample"],"content":"This will be unchanged"}',
    '{"title":"Hello!","phoneNumber":"+01-123-456-7890","author":{"familyName":null},'
    '"tags":["example"]}',
    '{"title":"Hello!","author":{"givenName":"John"},"tags":["example"],'
    '"content":"This will be unchanged","phoneNumber":"+01-123-456-7890"}',
)


@pytest.mark.parametrize(
    ("original", "patch", "result"),
    [*RFC7386_APPENDIX_A, RFC7386_SECTION_3],
    ids=[f"appendix-A-{i}" for i in range(1, 16)] + ["section-3"],
)
def test_every_rfc7386_example(original: str, patch: str, result: str) -> None:
    target, patch_doc = json.loads(original), json.loads(patch)
    assert apply_merge_patch(target, patch_doc) == json.loads(result)
    assert target == json.loads(original) and patch_doc == json.loads(patch), "inputs changed"


def test_the_rfc_examples_are_all_there() -> None:
    assert len(RFC7386_APPENDIX_A) == 15


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3))
json_documents = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("abcde"), inner, max_size=4)
    ),
    max_leaves=12,
)
"""Any JSON, nulls included (in objects a null deletes; inside lists it is a value)."""


@RELAXED
@given(target=json_documents, patch=json_documents)
def test_apply_agrees_with_an_independent_implementation(target: Any, patch: Any) -> None:
    expected = json_merge_patch.merge(copy.deepcopy(target), copy.deepcopy(patch))
    before = copy.deepcopy((target, patch))
    assert apply_merge_patch(target, patch) == expected
    assert (target, patch) == before, "apply_merge_patch changed its inputs"


@RELAXED
@given(old=objects, new=objects)
def test_diff_agrees_with_an_independent_implementation(
    old: dict[str, Any], new: dict[str, Any]
) -> None:
    assert merge_diff(old, new) == json_merge_patch.create_patch(old, new)
    assert json_merge_patch.merge(copy.deepcopy(old), merge_diff(old, new)) == new


def test_diff_of_equal_documents_is_empty_and_does_not_alias() -> None:
    doc = {"spec": {"template": {"spec": {"containers": [{"name": "x"}]}}}}
    assert merge_diff(doc, doc) == {}
    new = {"spec": {"template": {"spec": {"containers": [{"name": "y"}]}}}}
    patch = merge_diff(doc, new)
    patch["spec"]["template"]["spec"]["containers"][0]["name"] = "mutated"
    assert new["spec"]["template"]["spec"]["containers"][0]["name"] == "y"
