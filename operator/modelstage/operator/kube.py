"""Kubernetes building blocks shared by the stager Job and the serving pod patch.

Plain dicts in the API server's JSON shape: the planners return manifests, the kopf shell sends
them as they are. Names of everything the operator owns inside someone else's pod template
start with ``modelstage-``, which is how a later plan finds (and replaces) its own items.
"""

from __future__ import annotations

from modelstage.api.modeldeployment import S3Connection
from modelstage.api.objects import KubeObject

OWNED_PREFIX = "modelstage-"
ENGINE_CACHE_ANNOTATION = "modelstage.io/engine-cache"
"""On the serving pod template: the engine cache (its URI) prepare is given."""
MANAGED_ENV_ANNOTATION = "modelstage.io/managed-env"
"""Env var names the operator set in the vLLM container, so that a later plan can drop them."""
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

def pod_security_context() -> KubeObject:
    """Pod-level settings of the ``restricted`` Pod Security Standard."""
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_UID,
        "runAsGroup": NONROOT_UID,
        "fsGroup": NONROOT_UID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> KubeObject:
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


def secret_env(name: str, secret: str, key: str) -> KubeObject:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def s3_credentials_env(secret: str | None) -> list[KubeObject]:
    """AWS credentials by reference; nothing for workload identity."""
    if secret is None:
        return []
    return [
        secret_env("AWS_ACCESS_KEY_ID", secret, "AWS_ACCESS_KEY_ID"),
        secret_env("AWS_SECRET_ACCESS_KEY", secret, "AWS_SECRET_ACCESS_KEY"),
    ]


def ca_volume(connection: S3Connection | None) -> list[KubeObject]:
    if connection is None or connection.ca_bundle_secret is None:
        return []
    secret = {"secretName": connection.ca_bundle_secret, "items": [{"key": CA_KEY, "path": CA_KEY}]}
    return [{"name": VOLUME_CA, "secret": secret}]


def ca_mount(connection: S3Connection | None) -> list[KubeObject]:
    if connection is None or connection.ca_bundle_secret is None:
        return []
    return [{"name": VOLUME_CA, "mountPath": CA_DIR, "readOnly": True}]


def ca_file(connection: S3Connection | None) -> str | None:
    if connection is None or connection.ca_bundle_secret is None:
        return None
    return f"{CA_DIR}/{CA_KEY}"
