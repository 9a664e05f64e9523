"""``modelstage plan`` against what the running operator then does: the plan is computed
offline first, then the ModelDeployment is applied; the stager Job the operator creates and
the workload patch it sends must be what the plan showed.

The plan cannot know the ModelDeployment's uid (the API server assigns it): its Jobs carry
``OFFLINE_UID``, replaced here by the real one. On the real tier the API server adds defaults
to what it stores; the plan must be contained in the stored object, key for key."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from modelstage.operator.offline_plan import OFFLINE_UID
from modelstage.stager.plan import plan_deployment_report
from support.kube_cluster import Cluster
from support.modelstage_objects import (
    SPEC,
    complete_rollout,
    deploy_path,
    finish_stage_job,
    md_path,
    model_deployment,
    summary,
    vllm_deployment,
)
from support.operator_flow import MD, apply, wait_job, wait_phase, wait_rolled
from support.operator_process import TEST_SETTINGS, OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]


def contained(planned: Any, live: Any, where: str = "") -> list[str]:
    """Where ``planned`` differs from ``live``, ignoring what only ``live`` holds."""
    if isinstance(planned, dict) and isinstance(live, dict):
        return [d for k, v in planned.items()
                for d in (contained(v, live[k], f"{where}.{k}") if k in live else [f"{where}.{k}: missing"])]  # fmt: skip
    if isinstance(planned, list) and isinstance(live, list) and len(planned) == len(live):
        return [d for i, (p, q) in enumerate(zip(planned, live, strict=True))
                for d in contained(p, q, f"{where}[{i}]")]  # fmt: skip
    return [] if planned == live else [f"{where}: planned {planned!r}, live {live!r}"]


async def test_the_plan_shows_the_job_and_the_workload_patch_the_operator_then_makes(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    manifest = {**model_deployment(MD, SPEC), "metadata": {"name": MD, "namespace": namespace}}
    report = plan_deployment_report(
        manifest, namespace=None, workload=vllm_deployment(), checkpoint=None,
        stager_image=TEST_SETTINGS["MODELSTAGE_OPERATOR_STAGER_IMAGE"],
    )  # fmt: skip
    assert report["checks"] == []
    digest = report["digest"]

    await apply(cluster, namespace, SPEC)
    job = await wait_job(cluster, namespace, digest)
    md = await cluster.client.get(md_path(namespace, MD))
    assert md is not None
    [planned_job] = [j["manifest"] for j in report["jobs"]]
    planned_job = copy.deepcopy(planned_job)
    [reference] = planned_job["metadata"]["ownerReferences"]
    assert reference["uid"] == OFFLINE_UID
    reference["uid"] = md["metadata"]["uid"]
    assert contained(planned_job, job) == []
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == report["jobs"][0]["command"]

    await finish_stage_job(cluster.client, namespace, digest, message=summary(digest),
                           succeeded=True)  # fmt: skip
    rolled = await wait_rolled(cluster, namespace, digest)
    assert contained(report["vllm"]["mergePatch"]["spec"], rolled["spec"]) == []
    [container] = rolled["spec"]["template"]["spec"]["containers"]
    assert (container["command"], container["args"]) == (
        report["vllm"]["command"], report["vllm"]["args"]
    )
    await complete_rollout(cluster.client, namespace)
    await wait_phase(cluster, namespace, "Ready")
    assert (await cluster.client.get(deploy_path(namespace))) is not None
