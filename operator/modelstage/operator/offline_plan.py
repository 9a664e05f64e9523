"""``spec (+ workload) -> what the operator would do``, offline: the plan behind ``modelstage
plan``.

It calls the operator's own planners in the order the reconciler does (``validate_spec``,
``plan_resolve_job`` or ``artifact_for``, ``validate_workload``, ``check_claim_size``,
``staging_jobs``, ``plan_claim``, ``plan_rollout``), with nothing observed from a cluster: no
Job exists yet, the artifact claim is the one the spec describes, and the workload is the one
given, if any. The digest is taken from the source's resolved identity, which offline is
known only for a pinned commit or when given (``modelstage resolve`` prints it); otherwise
the plan is the resolve Job the operator runs first. What only a cluster can answer (an
existing claim's capacity, the Job's progress) is not here. The owner's uid is unknowable
offline: the Jobs carry ``OFFLINE_UID`` in their owner reference.
Pure and torch-free (the stager image runs it without the operator's kopf extras).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from modelstage.api.modeldeployment import DEFAULT_STAGER_IMAGE, ModelDeploymentSpec
from modelstage.api.objects import KubeObject, Owner
from modelstage.core.errors import SpecError
from modelstage.core.formats import AUTO
from modelstage.core.layouts import layout_for

from .artifact import Artifact, artifact_for
from .claim_plan import check_claim_size, plan_claim
from .job_plan import plan_resolve_job, staging_jobs
from .resolve_plan import describe, pinned_identity, resolve_job_name, source_status
from .rollout_plan import RolloutPlan, plan_rollout
from .validation import Finding, validate_spec, validate_workload

OFFLINE_UID = "00000000-0000-0000-0000-000000000000"
"""Stands for the ModelDeployment's uid, which the API server assigns on create."""


@dataclass(frozen=True)
class DeploymentPlan:
    namespace: str
    name: str
    artifact: Artifact | None
    """None when a finding blocks staging before the digest (e.g. an unknown vLLM version)."""
    jobs: list[KubeObject] = field(default_factory=list)
    """The Jobs in order: the resolve Job while the identity is unknown, else the staging
    Jobs (stage, then finalize when scaled out)."""
    identity: str | None = None
    """The source identity the digest is taken from (given, or a pinned commit)."""
    claim: KubeObject | None = None
    """The artifact PersistentVolumeClaim the operator would create, if any."""
    rollout: RolloutPlan | None = None
    """The workload patch, when a workload was given and nothing blocks the rollout."""
    findings: list[Finding] = field(default_factory=list)

    def blocks(self, what: str) -> list[Finding]:
        return [f for f in self.findings if f.blocks == what]


def _resolve_first(
    spec: ModelDeploymentSpec, owner: Owner, stager_image: str
) -> tuple[KubeObject, Finding]:
    """No identity is known: the resolve Job the operator would run first, and why the plan
    shows no digest."""
    job_name = resolve_job_name(spec, None, owner.name)
    job = plan_resolve_job(spec, owner=owner, name=job_name, default_image=stager_image)
    revision = f" --revision {spec.model.revision}" if spec.model.revision else ""
    first = f"the operator first resolves {describe(spec)} (Job {job_name}); "
    if spec.load_format == AUTO:
        return job, Finding(
            "Resolving",
            first + "with loadFormat auto the format, the digest and the staging Jobs follow "
            "from the architecture and quantization it reads (`modelstage resolve "
            f"{spec.model.uri}{revision} --describe` prints them): plan with the loadFormat "
            "it picks (status.format) to see them",
            "nothing",
        )
    return job, Finding(
        "Resolving",
        first + "the digest and the staging Jobs follow from the identity it finds: plan with "
        f"--identity (`modelstage resolve {spec.model.uri}{revision}` prints it) to see them",
        "nothing",
    )


def plan_deployment(
    spec: ModelDeploymentSpec,
    *,
    namespace: str,
    name: str,
    workload: KubeObject | None = None,
    stager_image: str = DEFAULT_STAGER_IMAGE,
    uid: str = OFFLINE_UID,
    identity: str | None = None,
) -> DeploymentPlan:
    """What the operator would plan for ``spec`` as ModelDeployment ``namespace/name``;
    ``identity``: the source's resolved identity (``modelstage resolve``), if known."""
    owner = Owner(name=name, namespace=namespace, uid=uid)
    findings = list(validate_spec(spec))
    artifact: Artifact | None = None
    identity = identity or pinned_identity(spec)
    if spec.load_format == AUTO:
        identity = None  # auto's format needs the resolve Job's reading of the config
    resolve_job: KubeObject | None = None
    if not any(f.blocks == "staging" for f in findings):
        artifact = _artifact(spec, namespace, name, identity, findings)
    if identity is None and not any(f.blocks == "staging" for f in findings):
        resolve_job, resolving = _resolve_first(spec, owner, stager_image)
        findings.append(resolving)
    if workload is not None:
        findings += validate_workload(spec, workload, namespace=namespace, deployment_name=name)
    too_small = check_claim_size(spec, None)
    if too_small is not None:
        findings.append(too_small)
    staging_blocked = any(f.blocks == "staging" for f in findings)
    jobs: list[KubeObject] = (
        [resolve_job] if resolve_job is not None and not staging_blocked else []
    )
    if artifact is not None and identity is not None and not staging_blocked:
        source = source_status(spec, identity, now=datetime.now(UTC))
        jobs = staging_jobs(
            spec, owner=owner, artifact=artifact, default_image=stager_image, source=source
        )
    rollout = None
    if (
        artifact is not None
        and workload is not None
        and not any(f.blocks in ("staging", "rollout") for f in findings)
    ):
        rollout = plan_rollout(spec, artifact, workload, default_image=stager_image)
    return DeploymentPlan(
        namespace=namespace,
        name=name,
        artifact=artifact,
        jobs=jobs,
        claim=plan_claim(spec, owner=owner) if not staging_blocked else None,
        rollout=rollout,
        findings=findings,
        identity=identity,
    )


def _artifact(
    spec: ModelDeploymentSpec,
    namespace: str,
    name: str,
    identity: str | None,
    findings: list[Finding],
) -> Artifact | None:
    """The artifact ``spec`` stages once its source's identity is known; a spec the layout
    or the artifact refuses adds its finding instead."""
    try:
        layout_for(spec.serving.vllm_version)
        if identity is not None:
            return artifact_for(spec, namespace=namespace, deployment_name=name, identity=identity)
    except SpecError as error:
        findings.append(Finding("InvalidSpec", str(error), "staging"))
    return None
