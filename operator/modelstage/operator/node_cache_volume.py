"""``(namespace, copy) -> the PersistentVolume and the claim a serving pod mounts it by``.

A serving pod sees only its own node-local copy, read-only, and nothing the tenant can
repoint: the operator creates a ``local`` PersistentVolume per (namespace, content)
(cluster-scoped, so the tenant cannot edit it; its path the copy's directory under the root,
its node affinity the copy's opaque node label, so pods land only on nodes that hold the
verified copy) pre-bound by ``claimRef`` to a claim in the tenant's namespace, and that claim
(``volumeName`` the PV, owned by the ModelDeployment). The workload mounts the claim
read-only (``rollout_plan``); the chart's admission policy refuses a pod that mounts such a
claim read-write. A PV whose claim is gone (the ModelDeployment deleted, the claim removed)
is deleted by the operator (``released``). Pure functions; ``act.py`` creates them.
"""

from __future__ import annotations

import hashlib
import posixpath

from modelstage.api.objects import KubeObject, Owner
from modelstage.core import node_cache as nc

CLAIM_PREFIX = "modelstage-node-cache-"
"""Claims of node-local copies: the admission policy forces their mounts read-only."""
PV_PREFIX = "modelstage-nc-"
STORAGE_CLASS = "modelstage-node-cache"
COMPONENT = "node-cache"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGED_BY = "modelstage-operator"
PV_LABELS = {LABEL_MANAGED: MANAGED_BY, LABEL_COMPONENT: COMPONENT}
"""What the operator lists its node-cache PVs by (and what its delete handler matches)."""
LABEL_NAMESPACE = "modelstage.io/claim-namespace"


def claim_name(content: str) -> str:
    """The claim in the tenant's namespace: one per content (at most 42 characters)."""
    return CLAIM_PREFIX + nc.check_content(content)[:20]


def volume_name(namespace: str, content: str) -> str:
    """The PV: one per (namespace, content); the namespace is hashed (a PV name is global)."""
    key = f"{namespace}/{nc.check_content(content)}".encode()
    return PV_PREFIX + hashlib.sha256(key).hexdigest()[:24]


def copy_path(root: str, content: str) -> str:
    """The copy's directory on the node."""
    return posixpath.join(root, nc.check_content(content))


def plan_volume(
    owner: Owner, content: str, size_bytes: int, *, root: str = nc.DEFAULT_ROOT
) -> tuple[KubeObject, KubeObject]:
    """(the PV, the claim) that give ``owner``'s namespace its copy of ``content``."""
    namespace, claim = owner.namespace, claim_name(content)
    capacity = {"storage": str(max(size_bytes, 1))}
    pv: KubeObject = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": volume_name(namespace, content),
            "labels": {**PV_LABELS, LABEL_NAMESPACE: namespace},
        },
        "spec": {
            "capacity": capacity,
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": STORAGE_CLASS,
            "volumeMode": "Filesystem",
            "local": {"path": copy_path(root, content)},
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "namespace": namespace, "name": claim},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": nc.content_label(content), "operator": "In", "values": ["true"]}
            ]}]}},
        },
    }  # fmt: skip
    pvc: KubeObject = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": claim,
            "namespace": namespace,
            "labels": {LABEL_MANAGED: MANAGED_BY, LABEL_COMPONENT: COMPONENT},
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": STORAGE_CLASS,
            "volumeName": pv["metadata"]["name"],
            "resources": {"requests": capacity},
        },
    }
    return pv, pvc


def released(pv: KubeObject, claim: KubeObject | None) -> bool:
    """Whether ``pv`` is one of the operator's node-cache PVs whose claim is gone: it was bound
    (the PV controller wrote the claim's uid into ``claimRef``) and that claim is deleted or
    replaced by another object of its name. A PV not bound yet is not: its claim is created
    right after it."""
    meta = pv.get("metadata") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in PV_LABELS.items()):
        return False
    bound = ((pv.get("spec") or {}).get("claimRef") or {}).get("uid")
    if not bound:
        return False
    return claim is None or bound != (claim.get("metadata") or {}).get("uid")
