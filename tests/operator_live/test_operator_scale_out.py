"""Scale-out staging through the operator: the Indexed Job, then the finalize Job, then the
rollout, with a real ``kopf run`` process (tier: kmock, or the real control plane when
``KUBEBUILDER_ASSETS`` is set). The tests play the Job controller and the kubelet."""

from __future__ import annotations

import json

import pytest
from modelstage.operator.job_plan import finalize_job_name, stage_job_name
from support.kube_cluster import Cluster
from support.modelstage_objects import (
    SPEC,
    complete_rollout,
    deploy_path,
    digest_of,
    finish_stage_job,
    job_path,
    merged,
    summary,
    template_digest,
)
from support.operator_flow import (
    apply,
    condition,
    status_of,
    wait_job,
    wait_named_job,
    wait_phase,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]
SCALED = merged(SPEC, {"stager": {"parallelism": 4}})


def worker_summary(digest: str, index: int) -> str:
    """What a ``modelstage stage --group i/4`` pod prints: no manifest, so no artifact yet."""
    return json.dumps({"digest": digest, "group": f"{index}/4", "files": 2, "bytes": 10})


async def test_indexed_job_then_finalize_job_then_rollout(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SCALED)
    digest = digest_of(SCALED)
    job = await wait_job(cluster, namespace, digest)
    assert (job["spec"]["completionMode"], job["spec"]["completions"]) == ("Indexed", 4)
    assert await cluster.client.get(job_path(namespace, finalize_job_name(digest))) is None

    await finish_stage_job(cluster.client, namespace, digest, message=worker_summary(digest, 3),
                           succeeded=True)  # fmt: skip
    final = await wait_named_job(cluster, namespace, finalize_job_name(digest))
    [pod_container] = final["spec"]["template"]["spec"]["containers"]
    assert pod_container["command"][:2] == ["modelstage", "finalize"]
    assert final["spec"]["completionMode"] == "NonIndexed"  # the API server's default
    status = await status_of(cluster, namespace)
    assert status["phase"] == "Staging", "the workers' parts are no artifact before finalize"
    assert template_digest(await cluster.client.get(deploy_path(namespace))) is None

    await finish_stage_job(cluster.client, namespace, digest, job_name=finalize_job_name(digest),
                           message=summary(digest, source="sha:5ca1ed"), succeeded=True)  # fmt: skip
    status = await wait_phase(cluster, namespace, "RollingOut")
    assert (status["artifact"]["digest"], status["artifact"]["source"]) == (digest, "sha:5ca1ed")
    await complete_rollout(cluster.client, namespace)
    await wait_phase(cluster, namespace, "Ready")
    assert await cluster.client.get(job_path(namespace, stage_job_name(digest))) is not None


async def test_failed_finalize_job_fails_staging_with_its_reason(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SCALED)
    digest = digest_of(SCALED)
    await wait_job(cluster, namespace, digest)
    await finish_stage_job(cluster.client, namespace, digest, message=worker_summary(digest, 0),
                           succeeded=True)  # fmt: skip
    await wait_named_job(cluster, namespace, finalize_job_name(digest))
    reason = "error: /mnt/x/model-rank-0-part-3.safetensors is missing (expected 5 bytes)"
    await finish_stage_job(cluster.client, namespace, digest, job_name=finalize_job_name(digest),
                           message=reason, succeeded=False)  # fmt: skip
    status = await wait_phase(cluster, namespace, "Failed")
    assert "model-rank-0-part-3.safetensors is missing" in condition(status, "Staged")["message"]
