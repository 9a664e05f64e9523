"""``spec -> PersistentVolumeClaim`` for ``storage.pvc.create``: the claim artifacts go to.

The claim carries no owner reference on purpose: it may hold artifacts that other
ModelDeployments of the namespace share, and deleting one ModelDeployment must not garbage-
collect them (artifact clean-up follows the retention policy, in the operator's finalizer).
"""

from __future__ import annotations

from .api import ModelDeploymentSpec
from .artifact import claim_name
from .kube import Manifest, Owner, labels


def plan_claim(spec: ModelDeploymentSpec, *, owner: Owner) -> Manifest | None:
    """The claim to create, or None when the spec names an existing claim or uses S3."""
    pvc = spec.storage.pvc
    if pvc is None or pvc.create is None:
        return None
    create = pvc.create
    claim_spec: Manifest = {
        "accessModes": list(create.access_modes),
        "resources": {"requests": {"storage": create.size}},
    }
    if create.storage_class_name is not None:
        claim_spec["storageClassName"] = create.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": claim_name(spec, owner.name),
            "namespace": owner.namespace,
            "labels": labels("artifacts", owner.name),
        },
        "spec": claim_spec,
    }
