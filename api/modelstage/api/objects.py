"""Object helpers every Kubernetes-facing part shares: the object type (``KubeObject``, plain
dicts in the API server's JSON shape), owner references to a ModelDeployment, the labels and
annotations that name modelstage's objects. Naming only: what goes into a Job or a pod is
the operator's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from .modeldeployment import API_VERSION, KIND

DIGEST_ANNOTATION = "modelstage.io/artifact-digest"
LABEL_DIGEST = "modelstage.io/digest"
LABEL_OWNER = "modelstage.io/model-deployment"
OPT_IN_ANNOTATION = "modelstage.io/model-deployment"
"""On a target workload: the one ModelDeployment (by name) that may patch it. A
workload without it is never patched: creating a ModelDeployment does not by itself grant
the right to change someone else's workload."""

KubeObject = dict[str, Any]
"""A Kubernetes object as the API server's JSON (not ``modelstage.json``, the core's
``Manifest``)."""


@dataclass(frozen=True)
class Owner:
    """The ModelDeployment that owns a child object."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> KubeObject:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def model_deployment_owners(manifest: KubeObject) -> set[str]:
    """UIDs of the ModelDeployments that control ``manifest`` (its controller owner
    references of our kind and API group). Names and labels can be copied by anyone who may
    create the object; an owner reference to a ModelDeployment is how the operator's own
    children are told apart."""
    group = API_VERSION.split("/", 1)[0]
    return {
        str(ref.get("uid"))
        for ref in (manifest.get("metadata") or {}).get("ownerReferences") or []
        if ref.get("controller")
        and ref.get("kind") == KIND
        and str(ref.get("apiVersion", "")).split("/", 1)[0] == group
        and ref.get("uid")
    }


LABEL_VALUE_MAX = 63
"""The API server refuses longer label values (422); object names may have up to 253."""


def label_value(name: str) -> str:
    """``name`` as a label value: itself when it fits, else a prefix and a hash of the whole
    name (stable, distinct for distinct names, within 63 characters, starting and ending
    with an alphanumeric character as label values must)."""
    if len(name) <= LABEL_VALUE_MAX:
        return name
    tail = hashlib.sha256(name.encode()).hexdigest()[:10]
    head = name[: LABEL_VALUE_MAX - len(tail) - 1].rstrip("-._")
    return f"{head}-{tail}"


def labels(component: str, owner_name: str, digest: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "modelstage",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "modelstage-operator",
        LABEL_OWNER: label_value(owner_name),
    }
    if digest is not None:
        out[LABEL_DIGEST] = digest
    return out
