"""``spec + digest -> stager Job``: the manifest of the Job that stages one artifact.

The Job's name comes from the digest alone, so two ModelDeployments of a namespace that want
the same artifact find one Job (the second sees "already exists" and follows it). Secrets are
referenced, never copied; the pod runs under the ``restricted`` Pod Security Standard; the
stager's last line lands in the termination message (``FallbackToLogsOnError``), where the
state machine reads the summary or the failure reason.
"""

from __future__ import annotations

import posixpath
from typing import Any

from .api import DEFAULT_STAGER_IMAGE, ModelDeploymentSpec, S3Connection
from .artifact import ARTIFACT_MOUNT, ArtifactLocation, locate
from .kube import (
    SCRATCH_DIR,
    SOURCE_MOUNT,
    VOLUME_ARTIFACTS,
    VOLUME_SCRATCH,
    VOLUME_SOURCE,
    Manifest,
    Owner,
    ca_file,
    ca_mount,
    ca_volume,
    container_security_context,
    labels,
    pod_security_context,
    s3_credentials_env,
    secret_env,
)

SCALE_OUT_FORMATS = frozenset({"sharded_state", "runai_streamer_sharded"})
"""Formats whose rank files an Indexed Job can write in parallel (tensor groups per pod)."""
HF_TOKEN_KEY = "HF_TOKEN"


def stage_job_name(digest: str) -> str:
    """Deterministic: one Job per artifact and namespace."""
    return f"modelstage-stage-{digest}"


def _source(spec: ModelDeploymentSpec) -> tuple[list[str], list[Manifest], list[Manifest]]:
    """The stager's SOURCE argument(s), and the volumes and mounts reading it needs."""
    uri = spec.model.uri
    if spec.model.scheme != "pvc":
        return [uri], [], []
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    local = posixpath.normpath(posixpath.join(SOURCE_MOUNT, path))
    volume = {
        "name": VOLUME_SOURCE,
        "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
    }
    mount = {"name": VOLUME_SOURCE, "mountPath": SOURCE_MOUNT, "readOnly": True}
    return [local, "--source-uri", uri], [volume], [mount]


def s3_connection(spec: ModelDeploymentSpec) -> S3Connection | None:
    """The one S3 connection the stager uses: the storage's, else the s3:// source's."""
    if spec.storage.s3 is not None:
        return spec.storage.s3
    return spec.model.s3 if spec.model.scheme == "s3" else None


def _s3_flags(connection: S3Connection | None) -> list[str]:
    if connection is None:
        return []
    flags: list[str] = []
    if connection.endpoint:
        flags += ["--s3-endpoint", connection.endpoint]
    if connection.region:
        flags += ["--s3-region", connection.region]
    if not connection.virtual_addressing:
        flags.append("--s3-path-style")
    ca = ca_file(connection)
    if ca:
        flags += ["--s3-ca-bundle", ca]
    return flags


def _credentials_env(spec: ModelDeploymentSpec) -> list[Manifest]:
    """HF token or S3 credentials, by Secret reference only."""
    model = spec.model
    env: list[Manifest] = []
    if model.scheme == "hf" and model.credentials_secret:
        env.append(secret_env("HF_TOKEN", model.credentials_secret, HF_TOKEN_KEY))
    if spec.storage.s3 is not None:
        # One set of AWS credentials in the pod: the storage's (a rule forbids a second one).
        env += s3_credentials_env(spec.storage.s3.credentials_secret)
    elif model.scheme == "s3":
        secret = model.credentials_secret or (model.s3.credentials_secret if model.s3 else None)
        env += s3_credentials_env(secret)
    return env


def _destination(location: ArtifactLocation) -> tuple[list[Manifest], list[Manifest]]:
    if location.claim_name is None:
        return [], []
    volume = {"name": VOLUME_ARTIFACTS, "persistentVolumeClaim": {"claimName": location.claim_name}}
    return [volume], [{"name": VOLUME_ARTIFACTS, "mountPath": ARTIFACT_MOUNT}]


def stager_command(spec: ModelDeploymentSpec, location: ArtifactLocation) -> list[str]:
    """``modelstage stage SOURCE --tp N ... --out DEST`` exactly as the stager CLI takes it."""
    source, _, _ = _source(spec)
    command = [
        "modelstage",
        "stage",
        source[0],
        "--tp",
        str(spec.parallelism.tensor),
        "--pp",
        str(spec.parallelism.pipeline),
        "--dtype",
        spec.dtype,
        "--format",
        spec.load_format,
        "--vllm-version",
        spec.serving.vllm_version,
        "--digest",
        location.digest,
        "--out",
        location.path,
    ]
    command += source[1:]
    if spec.model.revision is not None:
        command += ["--revision", spec.model.revision]
    return command + _s3_flags(s3_connection(spec))


def plan_stage_job(
    spec: ModelDeploymentSpec,
    *,
    owner: Owner,
    digest: str,
    default_image: str = DEFAULT_STAGER_IMAGE,
) -> Manifest:
    """The Job that stages ``digest`` for ``spec``; pure, deterministic."""
    location = locate(spec, namespace=owner.namespace, deployment_name=owner.name, digest=digest)
    _, source_volumes, source_mounts = _source(spec)
    dest_volumes, dest_mounts = _destination(location)
    connection = s3_connection(spec)
    stager = spec.stager
    workers = stager.parallelism if spec.load_format in SCALE_OUT_FORMATS else 1
    job_labels = labels("stager", owner.name, digest)

    env: list[Manifest] = [
        {"name": "HOME", "value": SCRATCH_DIR},
        {"name": "TMPDIR", "value": SCRATCH_DIR},
        {"name": "HF_HOME", "value": f"{SCRATCH_DIR}/hf"},
        *_credentials_env(spec),
    ]
    if workers > 1:
        # Each pod of the Indexed Job takes the tensor groups of its JOB_COMPLETION_INDEX.
        env.append({"name": "MODELSTAGE_WORKERS", "value": str(workers)})
    container: Manifest = {
        "name": "stager",
        "image": stager.image or default_image,
        "imagePullPolicy": "IfNotPresent",
        "command": stager_command(spec, location),
        "env": env,
        "volumeMounts": [
            {"name": VOLUME_SCRATCH, "mountPath": SCRATCH_DIR},
            *dest_mounts,
            *source_mounts,
            *ca_mount(connection),
        ],
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if stager.resources is not None:
        container["resources"] = stager.resources.wire()
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": [
            {"name": VOLUME_SCRATCH, "emptyDir": {}},
            *dest_volumes,
            *source_volumes,
            *ca_volume(connection),
        ],
    }
    if stager.service_account_name:
        pod_spec["serviceAccountName"] = stager.service_account_name
    if stager.node_selector:
        pod_spec["nodeSelector"] = dict(stager.node_selector)
    if stager.tolerations:
        pod_spec["tolerations"] = [t.wire() for t in stager.tolerations]
    job_spec: dict[str, Any] = {
        "backoffLimit": stager.backoff_limit,
        "activeDeadlineSeconds": stager.active_deadline_seconds,
        "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
    }
    if workers > 1:
        job_spec.update(completionMode="Indexed", completions=workers, parallelism=workers)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": stage_job_name(digest),
            "namespace": owner.namespace,
            "labels": job_labels,
            "annotations": {
                "modelstage.io/source-uri": spec.model.uri,
                "modelstage.io/artifact-uri": location.uri,
            },
            "ownerReferences": [owner.reference()],
        },
        "spec": job_spec,
    }
