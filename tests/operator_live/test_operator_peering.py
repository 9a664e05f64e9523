"""Two operator instances with kopf's peering (tier: kmock, or the real control plane when
``KUBEBUILDER_ASSETS`` is set): the lower priority pauses while the higher one lives, and
takes over once the higher one's peering record expires after it died.

Peering is not leader election: there is no lease and no fencing. An instance that dies
without a goodbye is presumed alive until its record's lifetime passes (here 4 s, 60 s by
default), and instances of equal priority all pause. The chart therefore runs one replica
with the Recreate strategy; peering only stops a second instance (one run by hand, a
second release) from fighting it (docs/install.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from modelstage.operator.job_plan import stage_job_name
from support.kube_cluster import Cluster, eventually
from support.modelstage_objects import (
    SPEC,
    deploy_path,
    digest_of,
    job_path,
    md_path,
    merged,
    model_deployment,
    vllm_deployment,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
PEERING = {"MODELSTAGE_OPERATOR_PEERING_LIFETIME": "4"}


def peering_object(ns: str) -> dict[str, Any]:
    return {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
            "metadata": {"name": "modelstage", "namespace": ns}}  # fmt: skip


async def job_of(cluster: Cluster, ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        return await cluster.client.get(job_path(ns, stage_job_name(digest_of(spec))))

    return await eventually(probe, timeout=30, what="the stage Job")


async def logged(process: OperatorProcess, text: str) -> None:
    async def probe() -> bool:
        return text in process.logs()

    await eventually(probe, timeout=30, what=f"{text!r} in the operator's log")


async def handled(process: OperatorProcess) -> None:
    async def probe() -> bool:
        return process.handled("modeldeployment_changed")

    await eventually(probe, timeout=30, what="the ModelDeployment handled")


async def test_two_operator_instances_with_peering_only_the_higher_priority_acts(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    ns = namespace
    await cluster.client.create(f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings",
                                peering_object(ns))  # fmt: skip
    (tmp_path / "high").mkdir()
    (tmp_path / "low").mkdir()
    high = OperatorProcess(cluster.kubeconfig, ns, tmp_path / "high", priority=100,
                           extra_env=PEERING)  # fmt: skip
    low = OperatorProcess(cluster.kubeconfig, ns, tmp_path / "low", priority=10,
                          extra_env=PEERING)  # fmt: skip
    try:
        await high.start()
        await low.start()
        await logged(low, "Pausing operations in favour of")

        first = merged(SPEC, {"serving": {"targetRef": {"name": "vllm-1"}}})
        await cluster.client.create(deploy_path(ns, None), vllm_deployment("vllm-1", model_deployment="first"))
        await cluster.client.create(md_path(ns), model_deployment("first", first))
        await job_of(cluster, ns, first)
        await handled(high)  # its log line may land just after the Job
        assert not low.handled("modeldeployment_changed"), "the paused instance acted"
        assert "Pausing" not in high.logs()

        await high.kill()  # no goodbye: its record expires after its lifetime
        await logged(low, "Resuming operations after the pause")
        second = merged(SPEC, {"dtype": "bfloat16", "serving": {"targetRef": {"name": "vllm-2"}}})
        await cluster.client.create(deploy_path(ns, None), vllm_deployment("vllm-2", model_deployment="second"))
        await cluster.client.create(md_path(ns), model_deployment("second", second))
        await job_of(cluster, ns, second)
        await handled(low)
    finally:
        await high.stop(graceful=False)
        await low.stop(graceful=False)
