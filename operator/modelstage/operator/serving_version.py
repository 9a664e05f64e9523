"""Which vLLM release the workload serves with, and so which per-rank layout to stage.

``spec.serving.vllmVersion`` when set; else the version in the tag of the vLLM container's
image (``vllm/vllm-openai:v0.30.1`` runs 0.30); else (no workload yet, a workload that did not
opt in, a digest-only or unversioned tag such as ``latest``) the default. A version outside
the layout table is refused, whichever way it was found. The artifact digest takes the
version's layout version, not the version: moving between releases that share a layout
restages nothing, moving to one with another layout stages a new artifact. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from modelstage.api.modeldeployment import ModelDeploymentSpec, VllmVersionStatus
from modelstage.api.objects import KubeObject
from modelstage.core.errors import SpecError
from modelstage.core.layouts import DEFAULT_VLLM_VERSION, layout_for

from .rollout_plan import select_container
from .validation import opt_in_problem
from .workload_kinds import serving_pod_spec

VERSION_TAG = re.compile(r"v?(?P<version>[0-9]+\.[0-9]+)(\.[0-9]+)*([-+][A-Za-z0-9_.+-]*)?")
"""A release tag: ``v0.30.1``, ``0.30``, ``v0.30.1-cpu``; ``latest`` or ``nightly`` are not."""
FROM_SPEC = "set in spec.serving.vllmVersion"


@dataclass(frozen=True)
class ServingVersion:
    version: str
    reason: str

    def status(self) -> VllmVersionStatus:
        return VllmVersionStatus(version=self.version, reason=self.reason)


def image_tag(image: str) -> str | None:
    """The tag of an image reference (``registry:5000/vllm:v0.30.1@sha256:...`` ->
    ``v0.30.1``), or None for a reference by digest or name only."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def image_vllm_version(image: str) -> str | None:
    """The major.minor release an image's tag names, or None when it names none."""
    tag = image_tag(image)
    match = VERSION_TAG.fullmatch(tag) if tag else None
    return match["version"] if match else None


def serving_version(
    spec: ModelDeploymentSpec, workload: KubeObject | None, *, namespace: str, deployment_name: str
) -> ServingVersion:
    """The vLLM version to stage for; ``SpecError`` when it has no layout."""
    if spec.serving.vllm_version is not None:
        layout_for(spec.serving.vllm_version)
        return ServingVersion(spec.serving.vllm_version, FROM_SPEC)
    image, unknown = _serving_image(spec, workload, namespace, deployment_name)
    if image is None:
        return _default(unknown)
    version = image_vllm_version(image)
    if version is None:
        return _default(f"the image {image} names no vLLM version in its tag")
    try:
        layout_for(version)
    except SpecError as error:
        raise SpecError(
            f"the vLLM container's image {image} runs vLLM {version}: {error}; use a supported "
            "vLLM image, or set spec.serving.vllmVersion to the version it runs"
        ) from None
    return ServingVersion(version, f"from the tag of the vLLM container's image {image}")


def with_version(spec: ModelDeploymentSpec, version: str) -> ModelDeploymentSpec:
    """``spec`` with ``serving.vllmVersion`` set: what every planner reads."""
    return spec.model_copy(
        update={"serving": spec.serving.model_copy(update={"vllm_version": version})}
    )


def recorded_version(spec: ModelDeploymentSpec, recorded: VllmVersionStatus | None) -> str:
    """The version a ModelDeployment stages for, as its status recorded it (another one's
    artifact, seen without its workload): the spec's, else the recorded, else the default."""
    if spec.serving.vllm_version is not None:
        return spec.serving.vllm_version
    return recorded.version if recorded is not None else DEFAULT_VLLM_VERSION


def _serving_image(
    spec: ModelDeploymentSpec, workload: KubeObject | None, namespace: str, deployment_name: str
) -> tuple[str | None, str]:
    """The vLLM container's image, or None and why it is not known. Nothing is read from a
    workload that did not opt in."""
    ref = spec.serving.target_ref
    if workload is None:
        return None, f"{ref.kind} {ref.name} is not found"
    if opt_in_problem(workload, namespace=namespace, deployment_name=deployment_name):
        return None, f"{ref.kind} {ref.name} has not opted in"
    try:
        container = select_container(spec, serving_pod_spec(workload))
    except SpecError:
        return None, f"the vLLM container of {ref.kind} {ref.name} is not known"
    image = container.get("image")
    if not isinstance(image, str) or not image:
        return None, f"the vLLM container of {ref.kind} {ref.name} names no image"
    return image, ""


def _default(why: str) -> ServingVersion:
    return ServingVersion(
        DEFAULT_VLLM_VERSION,
        f"{why}: the default {DEFAULT_VLLM_VERSION}; set spec.serving.vllmVersion to the "
        "version the workload runs",
    )
