"""The operator's security boundaries, with a real ``kopf run`` process against an API server.

- The stager image (also the serving initContainer's) is the operator's choice: a spec naming
  another image stages nothing and says why.
- A Job planted under a staging Job's predictable name is neither followed (its forged
  success would roll the workload onto whatever it wrote) nor counted against the stager
  slots; removing it lets the operator create its own.
- The clean-up Job of a deleted ModelDeployment runs the operator's image when the spec names
  one the operator does not allow.
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

from pathlib import Path
from typing import Any

import pytest
from modelstage.api.objects import OPT_IN_ANNOTATION, labels
from modelstage.operator.job_plan import cleanup_job_name, stage_job_name
from support.kube_cluster import Cluster, eventually
from support.modelstage_objects import (
    SPEC,
    complete_rollout,
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


def planted_job(digest: str) -> dict[str, Any]:
    """A Job under the stage Job's name and labels, as anyone who may create Jobs could."""
    job_labels = labels("stager", MD, digest)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": stage_job_name(digest), "labels": job_labels},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": job_labels},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "stager", "image": "attacker/img:latest"}],
                },
            },
        },
    }


async def test_a_job_planted_under_the_stage_jobs_name_is_not_followed(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    digest = digest_of(SPEC)
    await cluster.client.create(job_path(ns), planted_job(digest))
    # It even reports success, with a summary of the right digest.
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)
    await apply(cluster, ns, SPEC)
    status = await wait_phase(cluster, ns, "Failed")
    staged = condition(status, "Staged")
    assert (staged["status"], staged["reason"]) == ("False", "JobNotOwned")
    assert f"Job {stage_job_name(digest)} exists" in staged["message"]
    assert "artifact" not in status
    assert template_digest(await cluster.client.get(deploy_path(ns))) is None

    await cluster.client.delete(job_path(ns, stage_job_name(digest)))
    md = await cluster.client.get(md_path(ns, MD))
    assert md is not None

    async def own_job() -> dict[str, Any] | None:
        job = await cluster.client.get(job_path(ns, stage_job_name(digest)))
        refs = (job or {}).get("metadata", {}).get("ownerReferences") or []
        return job if any(r.get("uid") == md["metadata"]["uid"] for r in refs) else None

    await eventually(own_job, what="the operator's own stage Job")


async def test_a_planted_running_job_takes_no_stager_slot(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    ns = namespace
    process = OperatorProcess(cluster.kubeconfig, ns, tmp_path,
                              extra_env={"MODELSTAGE_OPERATOR_MAX_STAGER_JOBS": "1"})  # fmt: skip
    await cluster.client.create(job_path(ns), planted_job("f" * 20))  # never finishes
    await process.start()
    try:
        await apply(cluster, ns, SPEC)
        await wait_job(cluster, ns, digest_of(SPEC))
        assert "queuePosition" not in await status_of(cluster, ns)
    finally:
        await process.stop(graceful=False)


async def test_the_clean_up_of_a_spec_with_a_disallowed_image_runs_the_operators_image(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    await apply(cluster, ns, SPEC)
    digest = digest_of(SPEC)
    await wait_job(cluster, ns, digest)
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)
    await wait_rolled(cluster, ns, digest)
    await complete_rollout(cluster.client, ns)
    await wait_phase(cluster, ns, "Ready")
    await cluster.client.patch(md_path(ns, MD), {"spec": {"stager": {"image": "attacker/img:1"}}})
    await wait_phase(cluster, ns, "Failed")  # StagerImageNotAllowed
    await cluster.client.delete(md_path(ns, MD))
    uri = f"pvc://models/artifacts/{ns}/{digest}"

    async def cleanup() -> dict[str, Any] | None:
        return await cluster.client.get(job_path(ns, cleanup_job_name(digest, uri)))

    job = await eventually(cleanup, what="the clean-up Job")
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.test/modelstage/stager:test"
