"""The operator as a real ``kopf run`` process against a Kubernetes API over HTTP.

Tier: every test runs against the kmock API (``tests/support/kube_fake.py``) unless
``KUBEBUILDER_ASSETS`` provides kube-apiserver and etcd, in which case against that real
control plane. The tests play the Job and Deployment controllers and the kubelet by writing
statuses, on both tiers.

Only the real tier proves: that the API server accepts the operator's merge patches and
status writes under its own validation (CRD defaulting, pruning and CEL; Job and Deployment
validation), that owner references garbage-collect the Job
(``test_deleting_the_model_deployment_garbage_collects_its_job``, which needs
kube-controller-manager), and kopf against real watch semantics (bookmarks, 410 Gone).
The kmock tier emulates resourceVersion preconditions, generation, the ``/status``
subresource and CRD schema validation (not CEL), and counts the operator's requests, which is
how the restart tests prove "no duplicate Job, no second patch" there; on the real tier they
check the objects' uid and generation instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from modelstage.operator.job_plan import stage_job_name
from modelstage.operator.kube import DIGEST_ANNOTATION
from support.kube_cluster import TEST_AGENT, Cluster, eventually
from support.modelstage_objects import (
    SPEC,
    complete_rollout,
    crash_looping_pod,
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
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]
MD = "llama"
OPERATOR_AGENT = "OpenAPI-Generator"
"""The handlers' client (kubernetes package); kopf's own requests say ``kopf/...``."""


async def status_of(cluster: Cluster, ns: str, name: str = MD) -> dict[str, Any]:
    body = await cluster.client.get(md_path(ns, name)) or {}
    status: dict[str, Any] = body.get("status") or {}
    return status


async def wait_phase(cluster: Cluster, ns: str, phase: str, timeout: float = 20.0) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        status = await status_of(cluster, ns)
        return status if status.get("phase") == phase else None

    return await eventually(probe, timeout=timeout, what=f"phase {phase}")


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


async def events_for(cluster: Cluster, ns: str, name: str = MD) -> list[dict[str, Any]]:
    events = await cluster.client.list(f"/api/v1/namespaces/{ns}/events")
    return [e for e in events if (e.get("involvedObject") or {}).get("name") == name]


async def apply(cluster: Cluster, ns: str, spec: dict[str, Any], *, workload: bool = True) -> None:
    if workload:
        await cluster.client.create(deploy_path(ns, None), vllm_deployment())
    await cluster.client.create(md_path(ns), model_deployment(MD, spec))


async def wait_job(cluster: Cluster, ns: str, digest: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        return await cluster.client.get(job_path(ns, stage_job_name(digest)))

    return await eventually(probe, what=f"Job of {digest}")


async def staged_and_rolled(cluster: Cluster, ns: str, spec: dict[str, Any]) -> str:
    """Applies ``spec``, completes its Job and the rollout: the workload is Ready on it."""
    digest = digest_of(spec)
    await wait_job(cluster, ns, digest)
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)
    await wait_phase(cluster, ns, "RollingOut")
    await complete_rollout(cluster.client, ns)
    await wait_phase(cluster, ns, "Ready")
    return digest


def operator_writes(cluster: Cluster, method: str, path: str) -> int | None:
    """Requests the operator sent (kmock tier); None on the real tier (no request log)."""
    if cluster.fake is None:
        return None
    count: int = cluster.fake.writes(method, path, agent=OPERATOR_AGENT)
    return count


async def test_applying_a_model_deployment_creates_one_owned_stager_job_named_by_digest(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SPEC)
    digest = digest_of(SPEC)
    job = await wait_job(cluster, namespace, digest)
    md = await cluster.client.get(md_path(namespace, MD))
    assert md is not None
    assert job["metadata"]["name"] == f"modelstage-stage-{digest}"
    [owner] = job["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "ModelDeployment", MD, md["metadata"]["uid"], True
    )
    status = await wait_phase(cluster, namespace, "Staging")
    assert status["desiredDigest"] == digest
    assert status["observedGeneration"] == md["metadata"]["generation"]
    assert condition(status, "Staged")["status"] == "False"
    assert "--digest" in job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.test/modelstage/stager:test"
    # The workload is untouched until the artifact is complete.
    assert template_digest(await cluster.client.get(deploy_path(namespace))) is None
