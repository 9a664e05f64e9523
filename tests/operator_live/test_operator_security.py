"""The operator's security boundaries, with a real ``kopf run`` process against an API server.

- The stager image (also the serving initContainer's) is the operator's choice: a spec naming
  another image stages nothing and says why.
- A workload is patched only when it opts in: its metadata names the ModelDeployment in the
  annotation ``modelstage.io/model-deployment``. Without it the artifact is staged (staging
  touches nothing of the workload's), the workload is left as it was, and the status says why
  and what to add.

Tier: kmock unless ``KUBEBUILDER_ASSETS`` provides a control plane (see
test_operator_lifecycle.py). Only the real tier proves that the API server's own handling of
the workload (generation, resourceVersion, admission) saw no write from the operator; on
kmock the operator's request log shows it.
"""

from __future__ import annotations

from typing import Any

import pytest
from modelstage.operator.job_plan import stage_job_name
from modelstage.operator.kube import OPT_IN_ANNOTATION
from support.kube_cluster import Cluster, eventually
from support.modelstage_objects import (
    SPEC,
    deploy_path,
    digest_of,
    finish_stage_job,
    job_path,
    md_path,
    merged,
    model_deployment,
    summary,
    template_digest,
    vllm_deployment,
)
from support.operator_flow import MD, apply, condition, status_of, wait_job, wait_phase, wait_rolled
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]


async def test_a_workload_without_the_opt_in_is_not_patched_and_the_status_says_why(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    await cluster.client.create(deploy_path(ns, None), vllm_deployment(model_deployment=None))
    before = await cluster.client.get(deploy_path(ns))
    assert before is not None
    await cluster.client.create(md_path(ns), model_deployment(MD, SPEC))
    digest = digest_of(SPEC)
    await wait_job(cluster, ns, digest)  # staging goes on: it does not touch the workload
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)

    async def refused() -> dict[str, Any] | None:
        status = await status_of(cluster, ns)
        staged = condition(status, "Staged").get("status") == "True"
        return status if staged and condition(status, "Degraded").get("status") == "True" else None

    status = await eventually(refused, what="Staged and Degraded=TargetNotOptedIn")
    degraded, ready = condition(status, "Degraded"), condition(status, "Ready")
    assert status["phase"] == "Staged"
    assert degraded["reason"] == ready["reason"] == "TargetNotOptedIn"
    assert f"{OPT_IN_ANNOTATION}: {MD}" in degraded["message"]
    assert ready["status"] == "False"
    after = await cluster.client.get(deploy_path(ns))
    assert after is not None and template_digest(after) is None
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["metadata"].get("generation") == before["metadata"].get("generation")

    # The workload's owner consents: the same artifact is rolled out, nothing staged again.
    await cluster.client.patch(
        deploy_path(ns), {"metadata": {"annotations": {OPT_IN_ANNOTATION: MD}}}
    )
    await wait_rolled(cluster, ns, digest)


async def test_an_opt_in_for_another_model_deployment_is_refused(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    await cluster.client.create(deploy_path(ns, None), vllm_deployment(model_deployment="other"))
    await cluster.client.create(md_path(ns), model_deployment(MD, SPEC))
    digest = digest_of(SPEC)
    await wait_job(cluster, ns, digest)
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)

    async def refused() -> dict[str, Any] | None:
        status = await status_of(cluster, ns)
        reason = condition(status, "Degraded").get("reason")
        return status if reason == "TargetNotOptedIn" and status.get("phase") == "Staged" else None

    status = await eventually(refused, what="Degraded=TargetNotOptedIn")
    assert "opted in for ModelDeployment 'other'" in condition(status, "Degraded")["message"]
    assert template_digest(await cluster.client.get(deploy_path(ns))) is None


async def test_a_stager_image_the_operator_does_not_allow_stages_nothing(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    spec = merged(SPEC, {"stager": {"image": "attacker/img:latest"}})
    await apply(cluster, ns, spec)
    status = await wait_phase(cluster, ns, "Failed")
    staged = condition(status, "Staged")
    assert (staged["status"], staged["reason"]) == ("False", "StagerImageNotAllowed")
    assert "'attacker/img:latest' is not one of the stager images" in staged["message"]
    assert await cluster.client.get(job_path(ns, stage_job_name(digest_of(spec)))) is None
    assert template_digest(await cluster.client.get(deploy_path(ns))) is None
