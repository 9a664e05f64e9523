"""``spec -> PersistentVolumeClaim`` for ``storage.pvc.create``: the claim artifacts go to.

The claim carries no owner reference on purpose: it may hold artifacts that other
ModelDeployments of the namespace share, and deleting one ModelDeployment must not garbage-
collect them (artifact clean-up follows the retention policy, in the operator's finalizer).

**Size.** The operator never reads the source (it holds no credentials), so what it knows of the
checkpoint's size is what the spec says: ``model.sizeHint``. From it, the room the
artifacts need is ``sizeHint x dtype factor x (retention.keep + 1) x (1 + HEADROOM)``: the
kept artifacts plus the next one being staged while the current one serves; a per-rank
artifact holds about the checkpoint's bytes (norms and replicated KV heads add a little,
which the headroom covers); the dtype factor is 2 when the spec asks for float32, since the
source may be 16-bit. A claim to create gets that size when the spec gives none, and one
whose given size is smaller is refused before any Job starts; an existing claim is refused
when its capacity cannot hold even one artifact (what else it holds is not knowable here).
Without a hint nothing is checked and the stager's ``posix_fallocate`` of each part fails
early with "cannot reserve" on a full volume.
"""

from __future__ import annotations

import math
import re

from modelstage.api.modeldeployment import ModelDeploymentSpec, Quantity
from modelstage.api.objects import KubeObject, Owner, labels

from .artifact import claim_name
from .validation import Finding

HEADROOM = 0.2
_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")


def parse_quantity(quantity: Quantity) -> int:
    """Bytes of a storage quantity (``140Gi``, ``1.5T``, ``1000``); ValueError otherwise."""
    match = _QUANTITY.match(str(quantity).strip())
    if match is None or match.group(2) not in _SUFFIXES:
        raise ValueError(f"not a storage quantity: {quantity!r}")
    return math.ceil(float(match.group(1)) * _SUFFIXES[match.group(2)])


def gibibytes(n: int) -> str:
    """A quantity Kubernetes accepts, rounded up to whole Gi."""
    return f"{max(1, math.ceil(n / 2**30))}Gi"


def artifact_bytes(spec: ModelDeploymentSpec) -> int | None:
    """An upper estimate of one artifact's size, from ``model.sizeHint``; None without it."""
    if spec.model.size_hint is None:
        return None
    factor = 2 if spec.dtype == "float32" else 1
    return parse_quantity(spec.model.size_hint) * factor


def required_bytes(spec: ModelDeploymentSpec) -> int | None:
    """Room for the kept artifacts and the one being staged, plus headroom."""
    one = artifact_bytes(spec)
    if one is None:
        return None
    return math.ceil(one * (spec.retention.keep + 1) * (1 + HEADROOM))


def check_claim_size(spec: ModelDeploymentSpec, claim: KubeObject | None) -> Finding | None:
    """A claim that cannot hold the artifacts, found before any Job starts (blocks staging)."""
    pvc = spec.storage.pvc
    one = artifact_bytes(spec)
    if pvc is None or one is None:
        return None
    if claim is None and pvc.create is not None and pvc.create.size is not None:
        need = required_bytes(spec)
        assert need is not None
        if parse_quantity(pvc.create.size) < need:
            return Finding(
                "ClaimTooSmall",
                f"storage.pvc.create.size {pvc.create.size} is smaller than the {gibibytes(need)} "
                f"the artifacts need (model.sizeHint {spec.model.size_hint} x "
                f"(retention.keep {spec.retention.keep} + 1 being staged) + "
                f"{HEADROOM:.0%} headroom): raise it, or drop it to have it computed",
                "staging",
            )
    capacity = ((claim or {}).get("status") or {}).get("capacity", {}).get("storage")
    if capacity is not None and parse_quantity(capacity) < one * (1 + HEADROOM):
        return Finding(
            "ClaimTooSmall",
            f"PersistentVolumeClaim {(claim or {}).get('metadata', {}).get('name')} holds "
            f"{capacity}, less than one "
            f"artifact of model.sizeHint {spec.model.size_hint} plus {HEADROOM:.0%} headroom: "
            "use a larger claim",
            "staging",
        )
    return None


def plan_claim(spec: ModelDeploymentSpec, *, owner: Owner) -> KubeObject | None:
    """The claim to create, or None when the spec names an existing claim or uses S3."""
    pvc = spec.storage.pvc
    if pvc is None or pvc.create is None:
        return None
    create = pvc.create
    size = create.size
    if size is None:
        need = required_bytes(spec)
        assert need is not None, "a spec rule requires model.sizeHint without a size"
        size = gibibytes(need)
    claim_spec: KubeObject = {
        "accessModes": list(create.access_modes),
        "resources": {"requests": {"storage": size}},
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
