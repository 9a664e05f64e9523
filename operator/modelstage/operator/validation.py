"""Checks beyond the CRD schema, returned as findings (and a condition), never raised.

The schema and its CEL rules refuse what is wrong in the spec alone. What needs the cluster's
objects (the target workload, its container and GPUs, the artifact PVC's access modes) or
the project's tables (known vLLM layouts) is checked here; each finding says what blocks
(staging, or only the rollout, so that staging ahead of a workload still works) and what a
person should change.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from modelstage.api.modeldeployment import Condition, ModelDeploymentSpec
from modelstage.api.objects import OPT_IN_ANNOTATION, KubeObject
from modelstage.core.errors import SpecError
from modelstage.core.formats import FORMATS
from modelstage.core.layouts import layout_for

from .artifact import claim_name
from .conditions import condition
from .rollout_plan import ACCELERATORS, runs_vllm, template_container
from .workload_kinds import pod_count, replicas, serving_pod_spec, templates

Blocks = Literal["staging", "rollout", "nothing"]
MULTI_NODE_SAFE = frozenset({"ReadWriteMany", "ReadOnlyMany"})
HOST_LABEL = "kubernetes.io/hostname"


@dataclass(frozen=True)
class Finding:
    reason: str
    """CamelCase, for the condition's reason."""
    message: str
    blocks: Blocks


TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def image_allowed(image: str, allowed: Sequence[str]) -> bool:
    """Whether ``image`` is one of ``allowed``. An entry with a tag or a digest (``repo:tag``,
    ``repo@sha256:...``, ``repo:tag@sha256:...``) admits exactly itself: a tag entry does not
    admit ``repo:tag@sha256:<any>`` (the runtime pulls by the digest, whatever the tag says).
    A bare repository entry admits any of its tags and digests; never a longer repository
    (``repo-evil``, ``repo/evil``)."""
    for entry in allowed:
        if image == entry:
            return True
        if "@" in entry or ":" in entry.rsplit("/", 1)[-1] or not image.startswith(entry):
            continue
        tag, at, digest = image[len(entry) :].partition("@")
        if tag and (not tag.startswith(":") or not TAG.match(tag[1:])):
            continue
        if (at or not tag) and not DIGEST.match(digest):
            continue
        return True
    return False


def validate_spec(
    spec: ModelDeploymentSpec, *, allowed_images: Sequence[str] = ()
) -> list[Finding]:
    """What the spec alone cannot do, beyond what the schema refuses. ``allowed_images``:
    the images ``spec.stager.image`` may name (the operator's default comes first)."""
    findings: list[Finding] = []
    image = spec.stager.image
    if image is not None and not image_allowed(image, allowed_images):
        default = f"the operator's default {allowed_images[0]}" if allowed_images else "the default"
        findings.append(
            Finding(
                "StagerImageNotAllowed",
                f"spec.stager.image {image!r} is not one of the stager images this operator "
                f"allows ({', '.join(allowed_images) or 'none'}): it would run in the stager "
                f"Jobs and in the workload's pods; remove spec.stager.image to use {default}, "
                "or ask the operator's administrator to allow it (chart value "
                "stagerImage.allowed)",
                "staging",
            )
        )
    try:
        layout_for(spec.serving.vllm_version)
    except SpecError as error:
        findings.append(
            Finding("UnsupportedVllmVersion", f"spec.serving.vllmVersion: {error}", "staging")
        )
    findings += _pipeline_findings(spec)
    if spec.node_cache.enabled and not spec.serving.plugin:
        findings.append(
            Finding(
                "NodeCacheNeedsPlugin",
                "spec.nodeCache.enabled needs spec.serving.plugin: true (the loader plugin and "
                "its prepare initContainer read the node-local copy); turn the plugin on or "
                "node caching off",
                "staging",
            )
        )
    return findings


def _pipeline_findings(spec: ModelDeploymentSpec) -> list[Finding]:
    """What the stager refuses at a pipeline size above 1, said before any Job: a format or
    vLLM release whose loader cannot tell the stages' files apart, scale-out staging."""
    pp = spec.parallelism.pipeline
    if pp == 1:
        return []
    findings: list[Finding] = []
    if spec.load_format != "auto":
        try:
            FORMATS[spec.load_format].check_pipeline(pp, layout_for(spec.serving.vllm_version))
        except SpecError as error:
            findings.append(
                Finding("PipelineNotSupported", f"spec.parallelism.pipeline: {error}", "staging")
            )
    if spec.stager.workers > 1:
        findings.append(
            Finding(
                "PipelineNotSupported",
                f"spec.parallelism.pipeline is {pp}: scale-out staging (spec.stager.parallelism "
                f"{spec.stager.workers}) stages pipeline size 1 only; set spec.stager.parallelism "
                "to 1",
                "staging",
            )
        )
    return findings


def opt_in_problem(workload: KubeObject, *, namespace: str, deployment_name: str) -> str | None:
    """Why ``workload`` may not be patched for ModelDeployment ``deployment_name``, or None
    when its metadata names it in the opt-in annotation. Whoever may create ModelDeployments
    must not thereby gain the right to change every workload of the namespace: the workload's
    owner consents, on the workload."""
    meta = workload.get("metadata") or {}
    kind, name = workload.get("kind", "workload"), meta.get("name", "?")
    named = (meta.get("annotations") or {}).get(OPT_IN_ANNOTATION)
    if named == deployment_name:
        return None
    how = (
        f"add the annotation {OPT_IN_ANNOTATION}: {deployment_name} to the metadata of {kind} "
        f"{name} (namespace {namespace}) to let this ModelDeployment patch its pod template"
    )
    if named is None:
        return f"{kind} {name} has not opted in to modelstage: {how}"
    return f"{kind} {name} opted in for ModelDeployment {named!r}, not {deployment_name!r}: {how}"


def _gpus(container: KubeObject) -> tuple[str, int] | None:
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        amounts = resources.get(kind) or {}
        for name in ACCELERATORS:
            if name in amounts:
                try:
                    return name, int(str(amounts[name]))
                except ValueError:
                    return None
    return None


def _one_node(pod_spec: KubeObject) -> bool:
    return bool(pod_spec.get("nodeName")) or HOST_LABEL in (pod_spec.get("nodeSelector") or {})


def _access_modes(spec: ModelDeploymentSpec, claim: KubeObject | None) -> list[str] | None:
    pvc = spec.storage.pvc
    if pvc is None:
        return None
    if claim is not None:
        modes = (claim.get("status") or {}).get("accessModes") or (claim.get("spec") or {}).get(
            "accessModes"
        )
        return list(modes or [])
    return list(pvc.create.access_modes) if pvc.create else None


def validate_workload(
    spec: ModelDeploymentSpec,
    workload: KubeObject | None,
    *,
    namespace: str,
    deployment_name: str,
    claim: KubeObject | None = None,
) -> list[Finding]:
    """Whether the target workload can be rolled onto the artifact; ``claim`` is the observed
    artifact PVC (None when absent or not yet created)."""
    ref = spec.serving.target_ref
    target = f"{ref.kind} {ref.name}"
    if workload is None:
        return [
            Finding(
                "TargetNotFound",
                f"{target} not found in namespace {namespace}: create it or fix "
                "spec.serving.targetRef (staging goes on; the rollout waits for it)",
                "rollout",
            )
        ]
    refused = opt_in_problem(workload, namespace=namespace, deployment_name=deployment_name)
    if refused is not None:  # nothing more is read from a workload that did not consent
        return [Finding("TargetNotOptedIn", refused, "rollout")]
    containers = _containers(spec, workload, target)
    if isinstance(containers, Finding):
        return [containers]
    findings = _gpu_findings(spec, workload, containers, target)
    findings += _access_findings(spec, workload, claim, deployment_name, target)
    return findings


def _containers(
    spec: ModelDeploymentSpec, workload: KubeObject, target: str
) -> list[KubeObject] | Finding:
    """The container the roll edits in each pod template (the serving one first), or why one
    cannot be found or its command cannot be rewritten."""
    found: list[KubeObject] = []
    for i, (path, template) in enumerate(templates(workload)):
        where = target if i == 0 else f"{target} ({path[-1]})"
        try:
            container = template_container(spec, template.get("spec") or {}, serving=i == 0)
        except SpecError as error:
            return Finding("ContainerNotFound", f"{where}: {error}", "rollout")
        try:
            runs_vllm(container, serving=i == 0)
        except SpecError as error:
            name = container.get("name")
            return Finding(
                "VllmCommandNotRecognized", f"{where}, container {name}: {error}", "rollout"
            )
        found.append(container)
    return found


def _gpu_findings(
    spec: ModelDeploymentSpec, workload: KubeObject, containers: list[KubeObject], target: str
) -> list[Finding]:
    """Whether the vLLM pods have the GPUs the parallel sizes need: the one pod's (a
    Deployment's, a StatefulSet's), or a LeaderWorkerSet group's, its leader's and its
    workers' together (vLLM spreads TP x PP over the group's nodes)."""
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    counts = [_gpus(c) for c in containers]
    if any(c is None for c in counts):
        return []
    group = pod_count(workload) // max(replicas(workload), 1)
    resource = counts[0][0] if counts[0] else ACCELERATORS[0]
    per_pod = [c[1] for c in counts if c is not None]
    total = per_pod[0] + per_pod[-1] * (group - 1) if len(per_pod) > 1 else per_pod[0] * group
    if total >= tp * pp:
        return []
    sizes = f"spec.parallelism.tensor is {tp}" + (
        f" and spec.parallelism.pipeline {pp}" if pp > 1 else ""
    )
    fix = f"set its resources.limits[{resource!r}] to {tp * pp}"
    where = f"container {containers[0].get('name')} of {target} requests {total} {resource}"
    if group > 1:
        where = f"a group of {group} pods of {target} requests {total} {resource} in all"
        fix = f"set the leader's and workers' resources.limits[{resource!r}] to {tp * pp} in all"
    return [
        Finding(
            "InsufficientGPUs",
            f"{sizes} but {where}: {fix}, or lower the parallel sizes",
            "rollout",
        )
    ]


def _access_findings(
    spec: ModelDeploymentSpec,
    workload: KubeObject,
    claim: KubeObject | None,
    deployment_name: str,
    target: str,
) -> list[Finding]:
    """Whether every pod of the workload can mount the artifact's claim."""
    modes = _access_modes(spec, claim)
    if modes is None or MULTI_NODE_SAFE.intersection(modes):
        return []
    pods = pod_count(workload)
    noun = "replicas" if pods == replicas(workload) else "pods"
    pod_spec = serving_pod_spec(workload)
    claim_ = claim_name(spec, deployment_name)
    if "ReadWriteOncePod" in modes:
        return [
            Finding(
                "AccessModeTooNarrow",
                f"PVC {claim_} is ReadWriteOncePod: the stager and every vLLM pod of "
                f"{target} must mount it; use ReadWriteMany or ReadOnlyMany, or storage.s3",
                "rollout",
            )
        ]
    if pods > 1 and not _one_node(pod_spec):
        return [
            Finding(
                "ReadWriteOnceMultiNode",
                f"PVC {claim_} is ReadWriteOnce but {target} has {pods} {noun} that "
                "can land on different nodes, where they cannot mount it: use a "
                "ReadWriteMany or ReadOnlyMany claim, storage.s3, or pin the pods to one node",
                "nothing",
            )
        ]
    return []


def findings_condition(
    findings: list[Finding], *, now: datetime, generation: int | None = None
) -> Condition:
    """The ``Degraded`` condition the findings amount to (False with ``AsExpected`` if none)."""
    if not findings:
        return condition("Degraded", "False", "AsExpected", "", now=now, generation=generation)
    return condition(
        "Degraded",
        "True",
        findings[0].reason,
        "; ".join(f.message for f in findings),
        now=now,
        generation=generation,
    )
