"""``spec -> PVC`` for ``storage.pvc.create``: only when asked, valid, and never owned."""

from __future__ import annotations

import math
from collections.abc import Callable

import kubernetes_validate
import pytest
from modelstage.api.modeldeployment import ModelDeploymentSpec
from modelstage.api.objects import Owner
from modelstage.operator.claim_plan import (
    check_claim_size,
    parse_quantity,
    plan_claim,
    required_bytes,
)

SpecFactory = Callable[..., ModelDeploymentSpec]
OWNER = Owner(name="llama", namespace="llm", uid="u-1")


def test_existing_claim_or_s3_needs_no_claim(make_spec: SpecFactory) -> None:
    assert plan_claim(make_spec(), owner=OWNER) is None
    s3 = make_spec(loadFormat="tensorizer", storage={"pvc": None, "s3": {"uri": "s3://bkt/p"}})
    assert plan_claim(s3, owner=OWNER) is None


def test_claim_to_create_has_the_requested_shape_and_no_owner(make_spec: SpecFactory) -> None:
    create = {"storageClassName": "fast-rwx", "size": "200Gi", "accessModes": ["ReadWriteMany"]}
    claim = plan_claim(
        make_spec(storage={"pvc": {"claimName": None, "create": create}}), owner=OWNER
    )
    assert claim is not None
    assert claim["metadata"]["name"] == "modelstage-llama"
    assert claim["metadata"]["namespace"] == "llm"
    assert "ownerReferences" not in claim["metadata"]
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "200Gi"}},
        "storageClassName": "fast-rwx",
    }
    kubernetes_validate.validate(claim, kubernetes_validate.latest_version(), strict=True)


def test_named_claim_to_create_keeps_its_name_and_default_storage_class(
    make_spec: SpecFactory,
) -> None:
    claim = plan_claim(make_spec(storage={"pvc": {"create": {"size": 10**11}}}), owner=OWNER)
    assert claim is not None
    assert claim["metadata"]["name"] == "models"
    assert "storageClassName" not in claim["spec"]
    assert claim["spec"]["resources"]["requests"]["storage"] == 10**11


# -- size: what the operator can know without reading the source -------------------------------


def test_storage_quantities_parse_to_bytes() -> None:
    assert parse_quantity("140Gi") == 140 * 2**30
    assert parse_quantity("1.5T") == 1_500_000_000_000
    assert parse_quantity(1000) == 1000
    with pytest.raises(ValueError, match="not a storage quantity"):
        parse_quantity("12 bananas")


def test_a_claim_without_size_gets_the_artifacts_room_from_the_size_hint(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec(
        model={"uri": "hf://acme/llama", "sizeHint": "100Gi"},
        storage={"pvc": {"claimName": None, "create": {}}},
        retention={"keep": 2},
    )
    claim = plan_claim(spec, owner=OWNER)
    assert claim is not None
    # 100Gi x (2 kept + 1 being staged) x 1.2 headroom
    assert claim["spec"]["resources"]["requests"]["storage"] == "360Gi"
    assert required_bytes(spec) == math.ceil(100 * 2**30 * 3 * 1.2)


def test_float32_artifacts_of_a_16_bit_source_may_double_in_size(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"uri": "hf://acme/llama", "sizeHint": "10Gi"}, dtype="float32")
    assert required_bytes(spec) == math.ceil(2 * 10 * 2**30 * 3 * 1.2)


def test_a_claim_to_create_that_is_too_small_is_refused_before_any_job(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec(
        model={"uri": "hf://acme/llama", "sizeHint": "100Gi"},
        storage={"pvc": {"claimName": None, "create": {"size": "200Gi"}}},
    )
    finding = check_claim_size(spec, None)
    assert finding is not None and finding.blocks == "staging"
    assert "200Gi is smaller than the 360Gi" in finding.message
    roomy = make_spec(
        model={"uri": "hf://acme/llama", "sizeHint": "100Gi"},
        storage={"pvc": {"claimName": None, "create": {"size": "400Gi"}}},
    )
    assert check_claim_size(roomy, None) is None


def test_an_existing_claim_that_cannot_hold_one_artifact_is_refused(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec(model={"uri": "hf://acme/llama", "sizeHint": "100Gi"})
    small = {"metadata": {"name": "models"}, "status": {"capacity": {"storage": "110Gi"}}}
    finding = check_claim_size(spec, small)
    assert finding is not None and "models holds 110Gi" in finding.message
    big = {"metadata": {"name": "models"}, "status": {"capacity": {"storage": "1Ti"}}}
    assert check_claim_size(spec, big) is None
    assert check_claim_size(make_spec(), small) is None, "no hint: nothing is knowable"


def test_a_claim_to_create_needs_a_size_or_a_hint(make_spec: SpecFactory) -> None:
    with pytest.raises(ValueError, match=r"needs a size, or model\.sizeHint"):
        make_spec(storage={"pvc": {"claimName": None, "create": {}}})
