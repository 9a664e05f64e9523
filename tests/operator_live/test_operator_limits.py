"""The stage Job limit through the operator (tier: kmock, or the real control plane when
``KUBEBUILDER_ASSETS`` is set): with ``MODELSTAGE_OPERATOR_MAX_STAGER_JOBS=1`` a second
staging waits in the status (``Queued``, its position) until the first Job ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from modelstage.operator.job_plan import stage_job_name
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
    vllm_deployment,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]
SPECS = {name: merged(SPEC, {"dtype": dtype, "serving": {"targetRef": {"name": f"vllm-{name}"}}})
         for name, dtype in (("a", "auto"), ("b", "bfloat16"), ("c", "float16"))}  # fmt: skip


@pytest_asyncio.fixture
async def limited(cluster: Cluster, namespace: str, tmp_path: Path) -> AsyncIterator[None]:
    process = OperatorProcess(cluster.kubeconfig, namespace, tmp_path,
                              extra_env={"MODELSTAGE_OPERATOR_MAX_STAGER_JOBS": "1"})  # fmt: skip
    await process.start()
    try:
        yield
    finally:
        await process.stop(graceful=False)


async def status(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    body = await cluster.client.get(md_path(ns, name)) or {}
    found: dict[str, Any] = body.get("status") or {}
    return found


async def wait_queued(cluster: Cluster, ns: str, name: str, position: int) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        found = await status(cluster, ns, name)
        return found if found.get("queuePosition") == position else None

    return await eventually(probe, what=f"{name} queued at {position}")


async def wait_job(cluster: Cluster, ns: str, name: str) -> None:
    async def probe() -> bool:
        return (
            await cluster.client.get(job_path(ns, stage_job_name(digest_of(SPECS[name]))))
            is not None
        )

    await eventually(probe, what=f"the stage Job of {name}")


async def test_stagings_beyond_the_limit_wait_queued_in_order(
    cluster: Cluster, namespace: str, limited: None
) -> None:
    ns = namespace
    for name in ("a", "b", "c"):
        await cluster.client.create(deploy_path(ns, None), vllm_deployment(f"vllm-{name}", model_deployment=name))
        await cluster.client.create(md_path(ns), model_deployment(name, SPECS[name]))
        if name == "a":  # one at a time: the queue is in order of arrival at the operator
            await wait_job(cluster, ns, "a")
        elif name == "b":
            await wait_queued(cluster, ns, "b", 1)
    queued = await wait_queued(cluster, ns, "b", 1)
    assert queued["phase"] == "Pending"
    staged = next(c for c in queued["conditions"] if c["type"] == "Staged")
    assert (staged["status"], staged["reason"]) == ("False", "Queued")
    assert "position 1" in staged["message"] and "at most 1 stager Job" in staged["message"]
    await wait_queued(cluster, ns, "c", 2)
    for name in ("b", "c"):
        assert (
            await cluster.client.get(job_path(ns, stage_job_name(digest_of(SPECS[name])))) is None
        )

    digest = digest_of(SPECS["a"])
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)
    await wait_job(cluster, ns, "b")
    await wait_queued(cluster, ns, "c", 1)
    assert "queuePosition" not in await status(cluster, ns, "b")
    assert await cluster.client.get(job_path(ns, stage_job_name(digest_of(SPECS["c"])))) is None


async def test_a_claim_too_small_for_the_size_hint_fails_before_any_job_or_claim(
    cluster: Cluster, namespace: str, limited: None
) -> None:
    ns = namespace
    body = merged(SPECS["a"], {"model": {"sizeHint": "100Gi"}})
    body["storage"] = {"pvc": {"path": "/artifacts", "create": {"size": "50Gi"}}}
    await cluster.client.create(deploy_path(ns, None), vllm_deployment("vllm-a", model_deployment="a"))
    await cluster.client.create(md_path(ns), model_deployment("a", body))

    async def failed() -> dict[str, Any] | None:
        found = await status(cluster, ns, "a")
        return found if found.get("phase") == "Failed" else None

    found = await eventually(failed, what="a Failed")
    staged = next(c for c in found["conditions"] if c["type"] == "Staged")
    assert staged["reason"] == "ClaimTooSmall" and "50Gi is smaller than" in staged["message"]
    assert await cluster.client.get(job_path(ns, stage_job_name(digest_of(body)))) is None
    claims = await cluster.client.list(f"/api/v1/namespaces/{ns}/persistentvolumeclaims")
    assert claims == []
