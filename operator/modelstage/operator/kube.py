"""Kubernetes building blocks shared by the stager Job and the serving pod patch.

Plain dicts in the API server's JSON shape: the planners return manifests, the kopf shell sends
them as they are. Names of everything the operator owns inside someone else's pod template
start with ``modelstage-``, which is how a later plan finds (and replaces) its own items.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from .api import API_VERSION, KIND, S3Connection

OWNED_PREFIX = "modelstage-"
DIGEST_ANNOTATION = "modelstage.io/artifact-digest"
ENGINE_CACHE_ANNOTATION = "modelstage.io/engine-cache"
"""On the serving pod template: the engine cache (its URI) prepare is given."""
MANAGED_ENV_ANNOTATION = "modelstage.io/managed-env"
"""Env var names the operator set in the vLLM container, so that a later plan can drop them."""
LABEL_DIGEST = "modelstage.io/digest"
LABEL_OWNER = "modelstage.io/model-deployment"
OPT_IN_ANNOTATION = "modelstage.io/model-deployment"
"""On a Deployment or StatefulSet: the one ModelDeployment (by name) that may patch it. A
workload without it is never patched: creating a ModelDeployment does not by itself grant
the right to change someone else's workload."""

PLUGIN_DIR = "/opt/modelstage/plugins"
CA_DIR = "/etc/modelstage/s3-ca"
CA_KEY = "ca.crt"
SOURCE_MOUNT = "/mnt/modelstage/source"
SCRATCH_DIR = "/tmp"

VOLUME_ARTIFACTS = "modelstage-artifacts"
VOLUME_PLUGINS = "modelstage-plugins"
VOLUME_CA = "modelstage-s3-ca"
VOLUME_SOURCE = "modelstage-source"
VOLUME_SCRATCH = "modelstage-scratch"
VOLUME_NO_TOKEN = "modelstage-no-token"
VOLUME_ENGINE_CACHE = "modelstage-engine-cache"
"""The ``emptyDir`` the serving prepare places the engine cache in, vLLM's cache roots."""
ENGINE_CACHE_DIR = "/opt/modelstage/engine-cache"
VOLUME_NODE_CACHE = "modelstage-node-cache"
"""The nodes' cache root (a hostPath) in serving pods and copy Jobs (``spec.nodeCache``)."""
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Kubernetes mounts a pod's service-account token. A container that already mounts
something there does not get the token (the ServiceAccount admission plugin skips it): the
serving initContainer mounts an empty folder there, since it never calls the API."""

NONROOT_UID = 65532
"""The stager image's user (distroless ``nonroot``)."""

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Owner:
    """The ModelDeployment that owns a child object."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> Manifest:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def model_deployment_owners(manifest: Manifest) -> set[str]:
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


def pod_security_context() -> Manifest:
    """Pod-level settings of the ``restricted`` Pod Security Standard."""
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_UID,
        "runAsGroup": NONROOT_UID,
        "fsGroup": NONROOT_UID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> Manifest:
    """Container-level settings of the ``restricted`` standard (also for our initContainer in
    a workload whose pod-level context we do not own)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def secret_env(name: str, secret: str, key: str) -> Manifest:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def s3_credentials_env(secret: str | None) -> list[Manifest]:
    """AWS credentials by reference; nothing for workload identity."""
    if secret is None:
        return []
    return [
        secret_env("AWS_ACCESS_KEY_ID", secret, "AWS_ACCESS_KEY_ID"),
        secret_env("AWS_SECRET_ACCESS_KEY", secret, "AWS_SECRET_ACCESS_KEY"),
    ]


def ca_volume(connection: S3Connection | None) -> list[Manifest]:
    if connection is None or connection.ca_bundle_secret is None:
        return []
    secret = {"secretName": connection.ca_bundle_secret, "items": [{"key": CA_KEY, "path": CA_KEY}]}
    return [{"name": VOLUME_CA, "secret": secret}]


def ca_mount(connection: S3Connection | None) -> list[Manifest]:
    if connection is None or connection.ca_bundle_secret is None:
        return []
    return [{"name": VOLUME_CA, "mountPath": CA_DIR, "readOnly": True}]


def ca_file(connection: S3Connection | None) -> str | None:
    if connection is None or connection.ca_bundle_secret is None:
        return None
    return f"{CA_DIR}/{CA_KEY}"
