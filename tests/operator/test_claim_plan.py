"""``spec -> PVC`` for ``storage.pvc.create``: only when asked, valid, and never owned."""

from __future__ import annotations

from collections.abc import Callable

import kubernetes_validate
from modelstage.operator.api import ModelDeploymentSpec
from modelstage.operator.claim_plan import plan_claim
from modelstage.operator.kube import Owner

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
