"""The artifact a spec asks for: its digest and where it lives.

Both are pure functions of the spec, the namespace and the resolved source identity (a
branch's commit, the objects' ETags, the files' sizes and headers): the operator never reads
the source itself, a short resolve Job reports the identity (``resolve_plan.py``), and the
digest is the stager's own function of both, so a source that changed is a new artifact.
Artifacts are content-addressed per namespace, so two ModelDeployments asking for the same
bytes share one artifact.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from modelstage.api.modeldeployment import (
    ArtifactStatus,
    LoadFormat,
    ModelDeploymentSpec,
    VllmVersionStatus,
)
from modelstage.core.digest import artifact_digest
from modelstage.core.formats import FORMATS
from modelstage.core.layouts import layout_for

ARTIFACT_MOUNT = "/mnt/modelstage/artifacts"
"""Where stager and serving pods mount the artifact PVC."""
MANIFEST_FILE = "modelstage.json"


def spec_digest(spec: ModelDeploymentSpec, identity: str) -> str:
    """The artifact digest of a spec whose source resolved to ``identity``; raises
    ``SpecError`` for an unknown vLLM version."""
    return artifact_digest(
        uri=spec.model.uri,
        source=identity,
        tp=spec.parallelism.tensor,
        pp=spec.parallelism.pipeline,
        pp_partition=staged_partition(spec),
        dtype=spec.dtype,
        load_format=spec_format(spec),
        layout_version=layout_for(spec.serving.vllm_version).layout_version,
    )


def staged_partition(spec: ModelDeploymentSpec) -> tuple[int, ...] | None:
    """The layer partition the stager splits the files by: the spec's, for a per-rank format
    (the Hugging Face layout is the same files at any partition: vLLM alone reads it)."""
    partition = spec.parallelism.layer_partition
    if partition is None or not FORMATS[spec_format(spec)].per_rank:
        return None
    return tuple(partition)


def spec_format(spec: ModelDeploymentSpec) -> LoadFormat:
    """The spec's format; ``auto`` must have been decided first (``resolve_plan.
    concrete_spec``): an artifact is always of one format."""
    if spec.load_format == "auto":
        raise ValueError("loadFormat auto is decided once the source is resolved")
    return spec.load_format


@dataclass(frozen=True)
class ArtifactAddress:
    """One artifact's address, in the three spellings its users need."""

    digest: str
    uri: str
    """For people and the status: ``pvc://claim/path/ns/digest`` or ``s3://bucket/prefix/ns/digest``."""
    path: str
    """For pods: the folder on the mounted PVC, or the S3 URI (what ``--model`` gets)."""
    claim_name: str | None
    """The PVC to mount, or None for S3."""

    @property
    def on_pvc(self) -> bool:
        return self.claim_name is not None

    @property
    def manifest(self) -> str:
        return f"{self.path}/{MANIFEST_FILE}"


def claim_name(spec: ModelDeploymentSpec, deployment_name: str) -> str | None:
    """The artifact PVC's name: the spec's, or ``modelstage-<name>`` for one to create."""
    pvc = spec.storage.pvc
    if pvc is None:
        return None
    return pvc.claim_name or f"modelstage-{deployment_name}"


def locate(
    spec: ModelDeploymentSpec, *, namespace: str, deployment_name: str, digest: str
) -> ArtifactAddress:
    """Where the artifact of ``digest`` lives for this spec."""
    if spec.storage.s3 is not None:
        base = spec.storage.s3.uri.rstrip("/")
        uri = f"{base}/{namespace}/{digest}"
        return ArtifactAddress(digest=digest, uri=uri, path=uri, claim_name=None)
    pvc = spec.storage.pvc
    assert pvc is not None  # Storage's rule: exactly one kind.
    claim = claim_name(spec, deployment_name)
    inner = posixpath.normpath(posixpath.join("/", pvc.path, namespace, digest))
    return ArtifactAddress(
        digest=digest,
        uri=f"pvc://{claim}{inner}",
        path=f"{ARTIFACT_MOUNT}{inner}",
        claim_name=claim,
    )


@dataclass(frozen=True)
class Artifact:
    """What a rollout needs to know about one artifact: where, which format, which TP.

    Built from the spec for a new artifact, or from the status for a rollback (the spec may
    have moved on since the previous artifact was staged).
    """

    location: ArtifactAddress
    load_format: LoadFormat
    tp: int
    pp: int = 1
    pp_partition: tuple[int, ...] | None = None
    """Layers per pipeline stage (``VLLM_PP_LAYER_PARTITION``); None: vLLM's even split."""
    format_reason: str = ""
    """Why this format (``status.format``): the spec names it, or ``auto`` chose it."""
    vllm_version: VllmVersionStatus | None = None
    """The vLLM version it is staged for, and why (``status.vllmVersion``)."""

    @property
    def digest(self) -> str:
        return self.location.digest


def artifact_for(
    spec: ModelDeploymentSpec, *, namespace: str, deployment_name: str, identity: str
) -> Artifact:
    """The artifact the spec asks for, its source resolved to ``identity``; raises
    ``SpecError`` for an unknown vLLM version."""
    digest = spec_digest(spec, identity)
    return artifact_at(spec, namespace=namespace, deployment_name=deployment_name, digest=digest)


def artifact_at(
    spec: ModelDeploymentSpec, *, namespace: str, deployment_name: str, digest: str
) -> Artifact:
    """The spec's artifact of ``digest``: the one place after the digest that reads the
    spec's format and tensor-parallel size; the planners read them from the ``Artifact``."""
    location = locate(spec, namespace=namespace, deployment_name=deployment_name, digest=digest)
    parallelism = spec.parallelism
    partition = parallelism.layer_partition
    return Artifact(
        location, spec_format(spec), parallelism.tensor, parallelism.pipeline,
        None if partition is None else tuple(partition),
    )  # fmt: skip


def location_from_uri(uri: str, digest: str) -> ArtifactAddress:
    """Inverse of ``ArtifactAddress.uri``, for artifacts recorded in the status."""
    if uri.startswith("s3://"):
        return ArtifactAddress(digest=digest, uri=uri, path=uri, claim_name=None)
    if not uri.startswith("pvc://"):
        raise ValueError(f"not an artifact URI: {uri!r}")
    claim, _, inner = uri.removeprefix("pvc://").partition("/")
    return ArtifactAddress(
        digest=digest, uri=uri, path=f"{ARTIFACT_MOUNT}/{inner}", claim_name=claim
    )


def artifact_from_status(status: ArtifactStatus) -> Artifact:
    return Artifact(
        location_from_uri(status.uri, status.digest),
        status.format,
        status.tensor_parallel_size,
        status.pipeline_parallel_size,
        status.layer_partition,
    )
