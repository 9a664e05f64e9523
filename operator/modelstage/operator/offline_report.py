"""``modelstage plan``'s report for a ModelDeployment manifest: ``offline_plan``'s plan as the
JSON document the command prints (digest, artifact, Jobs, claim, vLLM container, checks).

The operator publishes ``deployment_report`` as the ``modelstage.planners`` entry point
(pyproject.toml); the stager's ``plan`` command looks it up there and adds the artifact's
files from a local checkpoint. So the stager runs the operator's planners without importing
the operator, and the report is the one place that turns a spec into what the operator does.
Pure: the checkpoint's ``config.json`` (for ``loadFormat: auto``) comes from the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from modelstage.api.modeldeployment import ModelDeploymentSpec
from modelstage.api.objects import KubeObject
from modelstage.core.errors import SpecError
from modelstage.core.formats import AUTO, choose_format
from modelstage.core.model_config import architecture_of, quantization_of
from pydantic import ValidationError

from .artifact import Artifact, staged_partition
from .offline_plan import plan_deployment
from .rollout_plan import RolloutPlan, select_container
from .serving_version import serving_version, with_version

Check = dict[str, Any]
ConfigReader = Callable[[], tuple[str, Mapping[str, Any]]]
"""Reads the local checkpoint's ``config.json``: (where it was read, its content)."""


def deployment_report(
    manifest: KubeObject,
    *,
    namespace: str | None,
    workload: KubeObject | None,
    stager_image: str,
    identity: str | None = None,
    read_config: ConfigReader | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The report (``files``: None, for the caller to fill) and the keyword arguments of the
    ``modelstage stage`` the operator would run for it (``tp``, ``pp``, ``pp_partition``,
    ``load_format``, ``dtype``, ``vllm_version``): what the caller plans the files with."""
    ns, name, spec = _deployment(manifest, namespace)
    spec, checks = _serving_version(spec, workload, ns, name)
    if spec.load_format == AUTO and read_config is not None:
        spec, auto = _auto_from(spec, read_config)
        checks += auto
    plan = plan_deployment(
        spec, namespace=ns, name=name, workload=workload, stager_image=stager_image,
        identity=identity,
    )  # fmt: skip
    checks += [dataclasses.asdict(f) for f in plan.findings]
    if workload is not None:
        checks += _other_workload(spec, workload)
    artifact = plan.artifact
    report: dict[str, Any] = {
        "kind": "ModelDeployment",
        "namespace": ns,
        "name": name,
        "digest": artifact.digest if artifact else None,
        "artifact": None if artifact is None else _artifact(spec, artifact),
        "source": {
            "uri": spec.model.uri,
            "revision": spec.model.revision,
            "identity": plan.identity,
        },
        "jobs": [_job(j) for j in plan.jobs],
        "claim": plan.claim,
        "files": None,
        "vllm": _vllm(spec, workload, plan.rollout) if workload is not None else None,
        "checks": checks,
    }
    pipeline = spec.parallelism
    partition = None if spec.load_format == AUTO else staged_partition(spec)
    stage = {"tp": pipeline.tensor, "pp": pipeline.pipeline, "pp_partition": partition,
             "load_format": spec.load_format, "dtype": spec.dtype,
             "vllm_version": spec.serving.vllm_version}  # fmt: skip
    return report, stage


def _deployment(
    manifest: KubeObject, namespace: str | None
) -> tuple[str, str, ModelDeploymentSpec]:
    """(namespace, name, spec) of a ModelDeployment manifest, refused as the API server
    would refuse it."""
    meta = manifest.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not name:
        raise SpecError("the ModelDeployment has no metadata.name")
    ns = namespace or str(meta.get("namespace") or "default")
    try:
        spec = ModelDeploymentSpec.model_validate(manifest.get("spec") or {})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "spec"
        raise SpecError(
            f"ModelDeployment {ns}/{name}: the API server would refuse it: spec.{where}: "
            f"{first.get('msg')}"
        ) from None
    return ns, name, spec


def _serving_version(
    spec: ModelDeploymentSpec, workload: KubeObject | None, namespace: str, name: str
) -> tuple[ModelDeploymentSpec, list[Check]]:
    """The spec with the vLLM version the operator would stage for (the spec's, the given
    workload's image tag, or the default; the report's ``artifact.vllmVersion``), or the
    spec as it is and the check that refuses a version without a layout."""
    try:
        chosen = serving_version(spec, workload, namespace=namespace, deployment_name=name)
    except SpecError as error:
        if spec.serving.vllm_version is not None:
            return spec, []  # the operator's validation reports the spec's own version
        check = {"reason": "UnsupportedVllmVersion", "blocks": "staging", "message": str(error)}
        return spec, [check]
    return with_version(spec, chosen.version), []


def _auto_from(
    spec: ModelDeploymentSpec, read_config: ConfigReader
) -> tuple[ModelDeploymentSpec, list[Check]]:
    """``loadFormat: auto`` decided as the operator will, from the local checkpoint's
    ``config.json`` (what the resolve Job reads of the source), and the check that says so."""
    where, found = read_config()
    config = found if isinstance(found, Mapping) else {}
    storage = "s3" if spec.storage.s3 is not None else "pvc"
    choice = choose_format(
        storage, architecture_of(config), quantization_of(config), spec.serving.vllm_version
    )
    message = f"loadFormat auto, from {where}: {choice.reason}"
    check = {"reason": "FormatChosen", "blocks": "nothing", "message": message}
    return spec.model_copy(update={"load_format": choice.format}), [check]


def _other_workload(spec: ModelDeploymentSpec, workload: KubeObject) -> list[Check]:
    """A warning when ``--workload`` is not the spec's target (the plan patches it anyway)."""
    ref = spec.serving.target_ref
    given = (workload.get("kind"), (workload.get("metadata") or {}).get("name"))
    if given == (ref.kind, ref.name):
        return []
    message = (
        f"--workload is {given[0]} {given[1]}, but spec.serving.targetRef is "
        f"{ref.kind} {ref.name}: the plan patches the one given"
    )
    return [{"reason": "WorkloadNotTheTarget", "blocks": "nothing", "message": message}]


def _artifact(spec: ModelDeploymentSpec, artifact: Artifact) -> dict[str, Any]:
    return {
        "uri": artifact.location.uri,
        "path": artifact.location.path,
        "claimName": artifact.location.claim_name,
        "format": spec.load_format,
        "tensorParallelSize": spec.parallelism.tensor,
        "dtype": spec.dtype,
        "vllmVersion": spec.serving.vllm_version,
    }


def _job(manifest: KubeObject) -> dict[str, Any]:
    spec = manifest["spec"]
    container = spec["template"]["spec"]["containers"][0]
    return {
        "name": manifest["metadata"]["name"],
        "pods": spec.get("completions", 1),
        "command": container["command"],
        "manifest": manifest,
    }


def _vllm(
    spec: ModelDeploymentSpec, workload: KubeObject, rollout: RolloutPlan | None
) -> dict[str, Any]:
    where = f"{workload.get('kind')} {(workload.get('metadata') or {}).get('name')}"
    if rollout is None:
        return {"workload": where, "planned": False}
    pod = rollout.template.get("spec") or {}
    container = select_container(spec, pod)
    return {
        "workload": where,
        "planned": True,
        "container": container.get("name"),
        "command": container.get("command"),
        "args": container.get("args"),
        "env": [e.get("name") for e in container.get("env") or []],
        "initContainers": [
            {"name": c.get("name"), "command": c.get("command")}
            for c in pod.get("initContainers") or []
        ],
        "mergePatch": rollout.merge_patch,
    }
