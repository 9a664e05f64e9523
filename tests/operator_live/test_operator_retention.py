"""Retention and clean-up through the operator (tier: kmock, or the real control plane when
``KUBEBUILDER_ASSETS`` is set): the newest ``retention.keep`` artifacts stay, older ones go
by a clean-up Job unless another ModelDeployment of the namespace keeps them, and the
finalizer does the same on delete (or retains, per ``retention.onDelete``). The clean-up
Job's own run (``modelstage delete``) is proven in tests/stager/test_delete.py and
tests/s3/test_s3_delete.py."""

from __future__ import annotations

from typing import Any

import pytest
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
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
DTYPES = ("auto", "bfloat16", "float16")
"""Three specs of one model: three artifacts, one after the other."""


def spec(dtype: str, workload: str = "vllm", **extra: Any) -> dict[str, Any]:
    return merged(SPEC, {"dtype": dtype, "serving": {"targetRef": {"name": workload}}, **extra})


def uri(ns: str, digest: str) -> str:
    return f"pvc://models/artifacts/{ns}/{digest}"


async def phase(cluster: Cluster, ns: str, name: str, want: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        body = await cluster.client.get(md_path(ns, name)) or {}
        status: dict[str, Any] = body.get("status") or {}
        return status if status.get("phase") == want else None

    return await eventually(probe, timeout=20, what=f"{name} {want}")


async def stage_and_roll(
    cluster: Cluster, ns: str, name: str, body: dict[str, Any], workload: str
) -> str:
    """The Job controller, the kubelet and the Deployment controller, played by the test."""
    digest = digest_of(body)

    async def job() -> dict[str, Any] | None:
        return await cluster.client.get(job_path(ns, stage_job_name(digest)))

    found = await eventually(job, what=f"Job of {digest}")
    if not (found.get("status") or {}).get("conditions"):
        await finish_stage_job(cluster.client, ns, digest, message=summary(digest),
                               succeeded=True)  # fmt: skip

    async def rolled() -> bool:
        return template_digest(await cluster.client.get(deploy_path(ns, workload))) == digest

    await eventually(rolled, what=f"{workload} on {digest}")
    await complete_rollout(cluster.client, ns, workload)
    await phase(cluster, ns, name, "Ready")
    return digest


async def history(cluster: Cluster, ns: str, name: str) -> list[str]:
    body = await cluster.client.get(md_path(ns, name)) or {}
    return [a["digest"] for a in (body.get("status") or {}).get("artifacts") or []]


async def test_older_artifacts_go_by_clean_up_job_unless_shared_and_the_finalizer_cleans_up(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    # "other" serves the first artifact and keeps it.
    await cluster.client.create(deploy_path(ns, None), vllm_deployment("vllm-other", model_deployment="other"))
    other = spec(DTYPES[0], "vllm-other")
    await cluster.client.create(md_path(ns), model_deployment("other", other))
    shared = await stage_and_roll(cluster, ns, "other", other, "vllm-other")

    # "llama" goes through three artifacts; keep: 2.
    await cluster.client.create(deploy_path(ns, None), vllm_deployment())
    await cluster.client.create(md_path(ns), model_deployment("llama", spec(DTYPES[0])))
    digests = [await stage_and_roll(cluster, ns, "llama", spec(DTYPES[0]), "vllm")]
    for dtype in DTYPES[1:]:
        await cluster.client.patch(md_path(ns, "llama"), {"spec": {"dtype": dtype}})
        digests.append(await stage_and_roll(cluster, ns, "llama", spec(dtype), "vllm"))
    assert digests[0] == shared

    async def trimmed() -> list[str] | None:
        found = await history(cluster, ns, "llama")
        return found if len(found) == 2 else None

    assert await eventually(trimmed, what="llama's history trimmed") == digests[:0:-1]
    # The first artifact is let go by llama but kept by "other": no clean-up Job, its
    # staging Job stays.
    assert await cluster.client.get(job_path(ns, cleanup_job_name(shared, uri(ns, shared)))) is None
    assert await cluster.client.get(job_path(ns, stage_job_name(shared))) is not None

    # Deleting "other" runs its finalizer: nothing else keeps the first artifact now.
    await cluster.client.delete(md_path(ns, "other"))

    async def cleanup() -> dict[str, Any] | None:
        return await cluster.client.get(job_path(ns, cleanup_job_name(shared, uri(ns, shared))))

    job = await eventually(cleanup, what="the clean-up Job of the shared artifact")
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["modelstage", "delete", "--artifact"]
    assert container["command"][3].endswith(f"/{ns}/{shared}")

    async def gone() -> bool:
        return await cluster.client.get(md_path(ns, "other")) is None

    await eventually(gone, what="other deleted once its finalizer ran")
    for kept in digests[1:]:  # llama's two artifacts are untouched
        assert await cluster.client.get(job_path(ns, cleanup_job_name(kept, uri(ns, kept)))) is None


async def test_retain_policy_leaves_the_artifacts_when_the_model_deployment_is_deleted(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    body = spec(DTYPES[0], retention={"keep": 2, "onDelete": "Retain"})
    await cluster.client.create(deploy_path(ns, None), vllm_deployment())
    await cluster.client.create(md_path(ns), model_deployment("llama", body))
    digest = await stage_and_roll(cluster, ns, "llama", body, "vllm")
    md = await cluster.client.get(md_path(ns, "llama"))
    assert md is not None and md["metadata"].get("finalizers"), "the finalizer is in place"
    await cluster.client.delete(md_path(ns, "llama"))

    async def gone() -> bool:
        return await cluster.client.get(md_path(ns, "llama")) is None

    await eventually(gone, what="the ModelDeployment deleted")
    assert await cluster.client.get(job_path(ns, cleanup_job_name(digest, uri(ns, digest)))) is None
    assert operator.handled("modeldeployment_deleted")
