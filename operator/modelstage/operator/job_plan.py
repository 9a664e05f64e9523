"""``spec + artifact -> stager Job``: the manifest of the Job that stages one artifact.

The artifact (``artifact.py``: its digest taken) gives the location, the format and the
tensor-parallel size; the spec gives the source, the credentials and how the Job runs.

The Job's name comes from the digest alone, so two ModelDeployments of a namespace that want
the same artifact find one Job (the second sees "already exists" and follows it). Secrets are
referenced, never copied; the pod runs under the ``restricted`` Pod Security Standard; the
stager's last line lands in the termination message (``FallbackToLogsOnError``), where the
state machine reads the summary or the failure reason.
"""

from __future__ import annotations

import copy
import hashlib
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelstage.api.modeldeployment import (
    DEFAULT_STAGER_IMAGE,
    ArtifactStatus,
    ModelDeploymentSpec,
    S3Connection,
    SourceStatus,
    Stager,
)
from modelstage.api.objects import KubeObject, Owner, labels
from modelstage.core.formats import AUTO, FORMATS
from modelstage.core.layouts import DEFAULT_VLLM_VERSION
from modelstage.core.pipeline_parallel import spell_layer_partition

from .artifact import (
    ARTIFACT_MOUNT,
    Artifact,
    ArtifactAddress,
    location_from_uri,
    staged_partition,
)
from .kube import (
    SCRATCH_DIR,
    SOURCE_MOUNT,
    VOLUME_ARTIFACTS,
    VOLUME_SCRATCH,
    VOLUME_SOURCE,
    ca_file,
    ca_mount,
    ca_volume,
    container_security_context,
    pod_security_context,
    s3_credentials_env,
    secret_env,
)
from .observations import JobState
from .resolve_plan import RESOLVE_TTL_SECONDS

DEFAULT_RESOURCES: KubeObject = {
    "requests": {"cpu": "1", "memory": "1Gi"},
    "limits": {"memory": "4Gi"},
}
"""The stager's resources when ``spec.stager.resources`` is unset (which then replaces them
whole). Staging streams through fixed buffer pools (well under 1 GiB at TP=8, S3 included);
the limit leaves room for a tensorizer rank's largest tensor and stops a runaway input."""
CLEANUP_RESOURCES: KubeObject = {
    "requests": {"cpu": "100m", "memory": "128Mi"},
    "limits": {"memory": "512Mi"},
}
HF_TOKEN_KEY = "HF_TOKEN"


def stage_job_name(digest: str) -> str:
    """Deterministic: one Job per artifact and namespace."""
    return f"modelstage-stage-{digest}"


def finalize_job_name(digest: str) -> str:
    """The scale-out finalize Job of an artifact; as deterministic as the stage Job's."""
    return f"modelstage-finalize-{digest}"


def scale_out_workers(spec: ModelDeploymentSpec, artifact: Artifact) -> int:
    """Pods of the stage Job: ``stager.parallelism`` (``Stager.workers``; not the spec's
    ``parallelism``, the model's split) for the formats whose files an Indexed Job can write in
    parallel (tensor groups per pod), else 1."""
    return spec.stager.workers if FORMATS[artifact.load_format].scale_out else 1


@dataclass(frozen=True)
class StagingStep:
    """Which of an artifact's staging Jobs to create next, and which one to follow."""

    create: str | None
    """A Job to create (the next one in order that does not exist yet)."""
    follow: str | None
    """The Job whose state is staging's state (running, failed, or the last one done)."""


def staging_step(names: Sequence[str], states: Mapping[str, JobState]) -> StagingStep:
    """Walk the Jobs in order (stage, then finalize when scaled out): create the first one
    missing once every earlier one succeeded; otherwise follow the first one not succeeded,
    or the last one. Pure: ``states`` holds the Jobs that exist."""
    for i, name in enumerate(names):
        state = states.get(name)
        if state is None:
            return StagingStep(create=name, follow=None)
        if state != "Succeeded" or i == len(names) - 1:
            return StagingStep(create=None, follow=name)
    raise ValueError("no staging Jobs")


def staging_jobs(
    spec: ModelDeploymentSpec,
    *,
    owner: Owner,
    artifact: Artifact,
    default_image: str = DEFAULT_STAGER_IMAGE,
    source: SourceStatus | None = None,
) -> list[KubeObject]:
    """The Jobs that stage ``artifact``, in order: the stage Job, and when it is an Indexed Job
    (``stager.parallelism`` > 1) the small finalize Job that checks and publishes its parts.
    ``source``: the resolved identity the digest was taken from (``stager_command``)."""
    jobs = [
        plan_stage_job(
            spec, owner=owner, artifact=artifact, default_image=default_image, source=source
        )
    ]
    if scale_out_workers(spec, artifact) > 1:
        jobs.append(
            plan_finalize_job(
                spec, owner=owner, artifact=artifact, default_image=default_image, source=source
            )
        )
    return jobs


def _source(spec: ModelDeploymentSpec) -> tuple[list[str], list[KubeObject], list[KubeObject]]:
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
    return [local, f"--source-uri={uri}"], [volume], [mount]


def s3_connection(spec: ModelDeploymentSpec) -> S3Connection | None:
    """The one S3 connection the stager uses: the storage's, else the s3:// source's."""
    if spec.storage.s3 is not None:
        return spec.storage.s3
    return spec.model.s3 if spec.model.scheme == "s3" else None


def _s3_flags(connection: S3Connection | None) -> list[str]:
    if connection is None:
        return []
    # Spec values as --flag=value: a value that looks like a flag stays a value.
    flags: list[str] = []
    if connection.endpoint:
        flags.append(f"--s3-endpoint={connection.endpoint}")
    if connection.region:
        flags.append(f"--s3-region={connection.region}")
    if not connection.virtual_addressing:
        flags.append("--s3-path-style")
    ca = ca_file(connection)
    if ca:
        flags += ["--s3-ca-bundle", ca]
    return flags


def _credentials_env(spec: ModelDeploymentSpec) -> list[KubeObject]:
    """HF token or S3 credentials, by Secret reference only."""
    model = spec.model
    env: list[KubeObject] = []
    if model.scheme == "hf" and model.credentials_secret:
        env.append(secret_env("HF_TOKEN", model.credentials_secret, HF_TOKEN_KEY))
    if spec.storage.s3 is not None:
        # One set of AWS credentials in the pod: the storage's (a rule forbids a second one).
        env += s3_credentials_env(spec.storage.s3.credentials_secret)
    elif model.scheme == "s3":
        secret = model.credentials_secret or (model.s3.credentials_secret if model.s3 else None)
        env += s3_credentials_env(secret)
    return env


def _destination(location: ArtifactAddress) -> tuple[list[KubeObject], list[KubeObject]]:
    if location.claim_name is None:
        return [], []
    volume = {"name": VOLUME_ARTIFACTS, "persistentVolumeClaim": {"claimName": location.claim_name}}
    return [volume], [{"name": VOLUME_ARTIFACTS, "mountPath": ARTIFACT_MOUNT}]


def stager_command(
    spec: ModelDeploymentSpec,
    artifact: Artifact,
    subcommand: str = "stage",
    source: SourceStatus | None = None,
) -> list[str]:
    """``modelstage stage SOURCE --tp N ... --out DEST`` exactly as the stager CLI takes it
    (``finalize`` takes the same arguments). An Indexed Job's pods find their group in
    ``JOB_COMPLETION_INDEX`` and ``MODELSTAGE_WORKERS`` (the stager's ``--group`` default).

    With the resolved ``source``: ``--expect-identity`` (a source that changed since it was
    resolved is refused, not staged under this digest) and, for hf://, the resolved commit
    as the revision (a branch that moves meanwhile cannot change what is staged). The
    tensor-parallel size and the format are the artifact's (its digest is taken)."""
    location = artifact.location
    source_args, _, _ = _source(spec)
    resolved = source
    command = [
        "modelstage",
        subcommand,
        source_args[0],
        "--tp",
        str(artifact.tp),
        "--pp",
        str(spec.parallelism.pipeline),
        "--dtype",
        spec.dtype,
        "--format",
        artifact.load_format,
        "--vllm-version",
        spec.serving.vllm_version or DEFAULT_VLLM_VERSION,
        "--digest",
        location.digest,
        "--out",
        location.path,
    ]
    partition = staged_partition(spec)
    if partition is not None:
        command.append(f"--pp-layer-partition={spell_layer_partition(partition)}")
    command += source_args[1:]
    # Values as --flag=value: free text such as `--allow-pickle` must stay a revision.
    revision = resolved.commit if resolved is not None and resolved.commit else None
    if revision or spec.model.revision is not None:
        command.append(f"--revision={revision or spec.model.revision}")
    if resolved is not None:
        command.append(f"--expect-identity={resolved.identity}")
    return command + _s3_flags(s3_connection(spec))


def plan_stage_job(
    spec: ModelDeploymentSpec,
    *,
    owner: Owner,
    artifact: Artifact,
    default_image: str = DEFAULT_STAGER_IMAGE,
    source: SourceStatus | None = None,
) -> KubeObject:
    """The Job that stages ``artifact`` for ``spec``; pure, deterministic."""
    return _plan_job(spec, owner, artifact, default_image, finalize=False, source=source)


def plan_finalize_job(
    spec: ModelDeploymentSpec,
    *,
    owner: Owner,
    artifact: Artifact,
    default_image: str = DEFAULT_STAGER_IMAGE,
    source: SourceStatus | None = None,
) -> KubeObject:
    """One pod, the stage Job's volumes and arguments, ``modelstage finalize``: it reads the
    source's config and headers (not its weights), checks every part and publishes."""
    return _plan_job(spec, owner, artifact, default_image, finalize=True, source=source)


def _plan_job(
    spec: ModelDeploymentSpec,
    owner: Owner,
    artifact: Artifact,
    default_image: str,
    *,
    finalize: bool,
    source: SourceStatus | None = None,
) -> KubeObject:
    location, digest = artifact.location, artifact.digest
    _, source_volumes, source_mounts = _source(spec)
    dest_volumes, dest_mounts = _destination(location)
    connection = s3_connection(spec)
    stager = spec.stager
    workers = 1 if finalize else scale_out_workers(spec, artifact)
    env = [*_scratch_env(), *_credentials_env(spec)]
    if workers > 1:
        # Each pod of the Indexed Job takes the tensor groups of its JOB_COMPLETION_INDEX.
        env.append({"name": "MODELSTAGE_WORKERS", "value": str(workers)})
    command = stager_command(spec, artifact, "finalize" if finalize else "stage", source=source)
    mounts = [*dest_mounts, *source_mounts, *ca_mount(connection)]
    container = _container("stager", stager.image or default_image, command, env, mounts)
    resources = stager.resources
    container["resources"] = resources.wire() if resources else copy.deepcopy(DEFAULT_RESOURCES)
    scratch = scratch_bound(spec)
    if scratch.request is not None:
        _request_ephemeral_storage(container, scratch.request)
    volumes = [*dest_volumes, *source_volumes, *ca_volume(connection)]
    pod_spec = _pod_spec(container, scratch.size_limit, volumes, stager)
    job_labels = labels("stager", owner.name, digest)
    job_spec: dict[str, Any] = {
        "backoffLimit": stager.backoff_limit,
        "activeDeadlineSeconds": stager.active_deadline_seconds,
        "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
    }
    if workers > 1:
        job_spec.update(completionMode="Indexed", completions=workers, parallelism=workers)
    annotations = {
        "modelstage.io/source-uri": spec.model.uri,
        "modelstage.io/artifact-uri": location.uri,
        **({"modelstage.io/source-identity": source.identity} if source else {}),
    }
    name = finalize_job_name(digest) if finalize else stage_job_name(digest)
    return _job(name, owner.namespace, job_labels, annotations, job_spec, owner)


def _scratch_env() -> list[KubeObject]:
    """HOME, temporary files and the hub cache on the scratch volume."""
    return [
        {"name": "HOME", "value": SCRATCH_DIR},
        {"name": "TMPDIR", "value": SCRATCH_DIR},
        {"name": "HF_HOME", "value": f"{SCRATCH_DIR}/hf"},
    ]


def _container(
    name: str, image: str, command: list[str], env: list[KubeObject], mounts: list[KubeObject]
) -> KubeObject:
    """A container of the stager image: restricted, its last line the termination message,
    the scratch volume mounted first."""
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": env,
        "volumeMounts": [{"name": VOLUME_SCRATCH, "mountPath": SCRATCH_DIR}, *mounts],
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _pod_spec(
    container: KubeObject,
    scratch_limit: str | None,
    volumes: list[KubeObject],
    stager: Stager | None,
) -> KubeObject:
    """One pod, never restarted in place, no API token; the scratch volume (bounded to
    ``scratch_limit``) first; the spec's scheduling choices when ``stager`` is given."""
    scratch: KubeObject = {"sizeLimit": scratch_limit} if scratch_limit is not None else {}
    pod_spec: KubeObject = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": [{"name": VOLUME_SCRATCH, "emptyDir": scratch}, *volumes],
    }
    if stager is not None and stager.service_account_name:
        pod_spec["serviceAccountName"] = stager.service_account_name
    if stager is not None and stager.node_selector:
        pod_spec["nodeSelector"] = dict(stager.node_selector)
    if stager is not None and stager.tolerations:
        pod_spec["tolerations"] = [t.wire() for t in stager.tolerations]
    return pod_spec


def _job(
    name: str,
    namespace: str,
    job_labels: KubeObject,
    annotations: KubeObject,
    spec: KubeObject,
    owner: Owner | None = None,
) -> KubeObject:
    """A batch/v1 Job; owned by the ModelDeployment when ``owner`` is given."""
    metadata: KubeObject = {
        "name": name,
        "namespace": namespace,
        "labels": job_labels,
        "annotations": annotations,
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner.reference()]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


CLEANUP_TTL_SECONDS = 600
"""A finished clean-up Job goes away by itself: it has no owner (its ModelDeployment may be
gone) and a later delete of the same location needs the name again."""


def cleanup_job_name(digest: str, uri: str) -> str:
    """Deterministic per location (digest + a hash of the URI: one digest may sit on two
    storages)."""
    where = hashlib.sha256(uri.encode()).hexdigest()[:8]
    return f"modelstage-delete-{digest}-{where}"


def plan_cleanup_job(
    artifact: ArtifactStatus,
    *,
    namespace: str,
    owner_name: str,
    connection: S3Connection | None,
    image: str,
) -> KubeObject | None:
    """A one-pod Job running ``modelstage delete`` on one artifact: it mounts the artifact's
    claim (read from its ``pvc://`` URI), or reaches its S3 prefix with ``connection`` (the
    spec's storage.s3: credentials by Secret reference). None when an S3 artifact's
    connection is unknown (the spec moved to other storage): it is left, not guessed at."""
    location = location_from_uri(artifact.uri, artifact.digest)
    if not location.on_pvc and connection is None:
        return None
    volumes, mounts = _destination(location)
    s3 = None if location.on_pvc else connection
    job_labels = labels("cleanup", owner_name, artifact.digest)
    command = ["modelstage", "delete", "--artifact", location.path, "--digest", artifact.digest]
    env = [{"name": "HOME", "value": SCRATCH_DIR}]
    env += s3_credentials_env(s3.credentials_secret) if s3 else []
    container = _container("cleanup", image, command + _s3_flags(s3), env, mounts + ca_mount(s3))
    container["resources"] = copy.deepcopy(CLEANUP_RESOURCES)
    pod_spec = _pod_spec(container, None, [*volumes, *ca_volume(s3)], None)
    job_spec = {
        "backoffLimit": 3,
        "ttlSecondsAfterFinished": CLEANUP_TTL_SECONDS,
        "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
    }
    name = cleanup_job_name(artifact.digest, artifact.uri)
    annotations = {"modelstage.io/artifact-uri": artifact.uri}
    return _job(name, namespace, job_labels, annotations, job_spec)


RESOLVE_CONTAINER = "resolve"
RESOLVE_RESOURCES: KubeObject = {
    "requests": {"cpu": "100m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}
RESOLVE_DEADLINE_SECONDS = 600
"""A resolution is a metadata request, a listing or a few headers: minutes at most."""


def plan_resolve_job(
    spec: ModelDeploymentSpec,
    *,
    owner: Owner,
    name: str,
    default_image: str = DEFAULT_STAGER_IMAGE,
) -> KubeObject:
    """The Job that runs ``modelstage resolve`` on the spec's source (``resolve_plan.py``):
    the stage Job's image, source volume, credentials (by Secret reference), CA bundle and
    security context, but no artifact volume and no Indexed pods; its one-line JSON lands in
    the termination message. Owned by the ModelDeployment; gone by itself once finished."""
    source_args, source_volumes, source_mounts = _source(spec)
    connection = s3_connection(spec) if spec.model.scheme == "s3" else None
    stager = spec.stager
    job_labels = labels("resolve", owner.name)
    command = ["modelstage", "resolve", *source_args]
    if spec.model.revision is not None:
        command.append(f"--revision={spec.model.revision}")
    if spec.load_format == AUTO:  # the architecture and quantization auto decides by
        command.append("--describe")
    env = [*_scratch_env(), *_source_credentials_env(spec)]
    container = _container(
        RESOLVE_CONTAINER,
        stager.image or default_image,
        command + _s3_flags(connection),
        env,
        [*source_mounts, *ca_mount(connection)],
    )
    # A metadata request, a listing or the headers: a small pod whatever staging needs.
    container["resources"] = copy.deepcopy(RESOLVE_RESOURCES)
    volumes = [*source_volumes, *ca_volume(connection)]
    pod_spec = _pod_spec(container, SCRATCH_DEFAULT, volumes, stager)
    job_spec = {
        "backoffLimit": 1,
        "activeDeadlineSeconds": RESOLVE_DEADLINE_SECONDS,
        "ttlSecondsAfterFinished": RESOLVE_TTL_SECONDS,
        "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
    }
    annotations = {"modelstage.io/source-uri": spec.model.uri}
    return _job(name, owner.namespace, job_labels, annotations, job_spec, owner)


def _source_credentials_env(spec: ModelDeploymentSpec) -> list[KubeObject]:
    """What reading the source needs, no more: the stage Job's HF token or S3 credentials
    for an hf:// or s3:// source, never the storage's for another kind of source."""
    if spec.model.scheme == "pvc":
        return []
    if spec.model.scheme == "hf":
        return [e for e in _credentials_env(spec) if e["name"] == "HF_TOKEN"]
    return _credentials_env(spec)


# --- the stager's scratch space (ephemeral storage) ------------------------------------------
SCRATCH_DEFAULT = "2Gi"
"""The scratch volume's bound when nothing large lands there (HOME, temporary files): every
format streams into the artifact location, tensorizer included, so only a hub cache is big."""
HF_CACHE_DEFAULT = "200Gi"
"""The bound of an ``hf://`` Job's scratch volume (which holds the hub cache, i.e. the whole
checkpoint) when ``model.sizeHint`` is not set: a 70B bf16 checkpoint fits; set the hint
for anything larger. Not requested from the scheduler (it would exclude smaller nodes)."""
SCRATCH_HEADROOM = 0.1
CONTAINER_EPHEMERAL_EXTRA = 1 << 30
"""Beyond the scratch volume, the container's own writable layer and logs."""


@dataclass(frozen=True)
class ScratchBound:
    """The scratch ``emptyDir``'s ``sizeLimit``, and the ``ephemeral-storage`` the stager
    container requests and is limited to (None: nothing requested, the volume is bounded)."""

    size_limit: str
    request: str | None


def scratch_bound(spec: ModelDeploymentSpec) -> ScratchBound:
    """How much node-local disk a staging pod may use. An ``hf://`` source downloads the
    checkpoint into the hub cache under the scratch volume: ``model.sizeHint`` plus headroom
    (requested, so the pod lands on a node with room), else ``HF_CACHE_DEFAULT``. Every other
    source writes only small files there. A user's own ``ephemeral-storage`` limit wins."""
    from .claim_plan import gibibytes, parse_quantity

    user = ((spec.stager.resources.limits or {}) if spec.stager.resources else {}).get(
        "ephemeral-storage"
    )
    if user is not None:
        return ScratchBound(size_limit=str(user), request=None)
    if spec.model.scheme != "hf":
        size = parse_quantity(SCRATCH_DEFAULT)
    elif spec.model.size_hint is None:
        return ScratchBound(size_limit=HF_CACHE_DEFAULT, request=None)
    else:
        size = int(parse_quantity(spec.model.size_hint) * (1 + SCRATCH_HEADROOM)) + (1 << 30)
    return ScratchBound(
        size_limit=gibibytes(size), request=gibibytes(size + CONTAINER_EPHEMERAL_EXTRA)
    )


def _request_ephemeral_storage(container: KubeObject, amount: str) -> None:
    """Request and limit ``amount`` of ephemeral storage, unless the user's resources set
    either (a limit of ours below a request of theirs would be refused)."""
    resources = container.setdefault("resources", {})
    if any("ephemeral-storage" in (resources.get(k) or {}) for k in ("requests", "limits")):
        return
    for kind in ("requests", "limits"):
        resources.setdefault(kind, {})["ephemeral-storage"] = amount
