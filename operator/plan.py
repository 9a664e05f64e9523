"""``spec (+ workload) -> what the operator would do``, offline: the plan behind ``modelstage
plan``.

It calls the operator's own planners in the order the reconciler does (``validate_spec``,
``artifact_for``, ``validate_workload``, ``check_claim_size``, ``staging_jobs``,
``plan_claim``, ``plan_rollout``), with nothing observed from a cluster: no Job exists yet, the
artifact claim is the one the spec describes, and the workload is the one given, if any. What
only a cluster can answer (an existing claim's capacity, the Job's progress) is not here. The
owner's uid is unknowable offline: the Jobs carry ``OFFLINE_UID`` in their owner reference.
Pure and torch-free (the stager image runs it without the operator's kopf extras).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelstage.stager.errors import SpecError

from .api import DEFAULT_STAGER_IMAGE, ModelDeploymentSpec
from .artifact import Artifact, artifact_for
from .claim_plan import check_claim_size, plan_claim
from .job_plan import staging_jobs
from .kube import Manifest, Owner
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
    jobs: list[Manifest] = field(default_factory=list)
    """The staging Jobs in order (stage, then finalize when scaled out)."""
    claim: Manifest | None = None
    """The artifact PersistentVolumeClaim the operator would create, if any."""
    rollout: RolloutPlan | None = None
    """The workload patch, when a workload was given and nothing blocks the rollout."""
    findings: list[Finding] = field(default_factory=list)

    def blocks(self, what: str) -> list[Finding]:
        return [f for f in self.findings if f.blocks == what]


def plan_deployment(
    spec: ModelDeploymentSpec,
    *,
    namespace: str,
    name: str,
    workload: Manifest | None = None,
    stager_image: str = DEFAULT_STAGER_IMAGE,
    uid: str = OFFLINE_UID,
) -> DeploymentPlan:
    """What the operator would plan for ``spec`` as ModelDeployment ``namespace/name``."""
    owner = Owner(name=name, namespace=namespace, uid=uid)
    findings = list(validate_spec(spec))
    artifact: Artifact | None = None
    if not any(f.blocks == "staging" for f in findings):
        try:
            artifact = artifact_for(spec, namespace=namespace, deployment_name=name)
        except SpecError as error:
            findings.append(Finding("InvalidSpec", str(error), "staging"))
    if workload is not None:
        findings += validate_workload(spec, workload, namespace=namespace, deployment_name=name)
    too_small = check_claim_size(spec, None)
    if too_small is not None:
        findings.append(too_small)
    staging_blocked = any(f.blocks == "staging" for f in findings)
    jobs: list[Manifest] = []
    if artifact is not None and not staging_blocked:
        jobs = staging_jobs(spec, owner=owner, digest=artifact.digest, default_image=stager_image)
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
    )
