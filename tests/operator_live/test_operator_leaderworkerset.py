"""A ModelDeployment aimed at a LeaderWorkerSet (multi-node serving), on both tiers.

The LeaderWorkerSet CRD is the test support's structural one (``support/leaderworkerset.py``:
the release cannot be fetched here), applied before the operator starts; the operator runs
with the chart's RBAC on the real tier (get/list/watch/patch on leaderworkersets). The tests
play the LeaderWorkerSet controller (its pods and status) as the other live tests play the
Deployment controller. Only the real tier proves that the API server accepts the CRD's CEL
rule for LeaderWorkerSet targets and the operator's merge patch of both templates.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from support.kube_cluster import (
    ApiStatusError,
    Cluster,
    ControlPlane,
    eventually,
    kmock_cluster,
    real_cluster,
)
from support.leaderworkerset import (
    LWS,
    LWS_CRD,
    crash_looping_leader,
    lws_path,
    play_lws_controller,
    template_digests,
    vllm_lws,
)
from support.modelstage_objects import (
    SPEC,
    digest_of,
    finish_stage_job,
    md_path,
    merged,
    model_deployment,
    summary,
)
from support.operator_flow import (
    MD,
    condition,
    status_of,
    wait_event,
    wait_job,
    wait_phase,
)
from support.operator_process import OperatorProcess

from .conftest import CRD, PEERING_CRDS

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

LWS_SPEC = merged(
    SPEC,
    {
        "parallelism": {"tensor": 2, "pipeline": 2},
        "serving": {"targetRef": {"kind": "LeaderWorkerSet", "name": LWS}},
    },
)


@pytest_asyncio.fixture
async def cluster(
    real_control_plane: ControlPlane | None, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """The cluster with the LeaderWorkerSet API installed (before the operator starts)."""
    crds = [CRD, *PEERING_CRDS, LWS_CRD]
    if real_control_plane is None:
        async with kmock_cluster(crds, tmp_path) as fake_cluster:
            yield fake_cluster
        return
    async with real_cluster(real_control_plane, crds, tmp_path) as real:
        yield real


async def wait_lws_on(cluster: Cluster, ns: str, digest: str) -> dict[str, Any]:
    """Both templates on ``digest`` (one merge patch writes them together)."""

    async def probe() -> dict[str, Any] | None:
        lws = await cluster.client.get(lws_path(ns))
        return lws if template_digests(lws) == (digest, digest) else None

    return await eventually(probe, what=f"both templates on {digest}")


def arg(args: list[str], name: str) -> str:
    for i, token in enumerate(args):
        if token == name:
            return args[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


async def test_a_leaderworkerset_is_staged_rolled_in_both_templates_and_rolled_back(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    if cluster.fake is None:  # the CRD's CEL rule, on the real API server
        cached = merged(LWS_SPEC, {"nodeCache": {"enabled": True}})
        with pytest.raises(ApiStatusError) as refused:
            await cluster.client.create(md_path(namespace), model_deployment("cached", cached))
        assert refused.value.status == 422
        assert "does not support node caching" in str(refused.value.body)
    await cluster.client.create(lws_path(namespace, None), vllm_lws(MD))
    await play_lws_controller(cluster.client, namespace)  # serving the Hub model, Available
    await cluster.client.create(md_path(namespace), model_deployment(MD, LWS_SPEC))
    old = digest_of(LWS_SPEC)
    job = await wait_job(cluster, namespace, old)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--pp") + 1] == "2" and command[command.index("--tp") + 1] == "2"
    await finish_stage_job(cluster.client, namespace, old, message=summary(old), succeeded=True)

    lws = await wait_lws_on(cluster, namespace, old)
    templates = lws["spec"]["leaderWorkerTemplate"]
    for template in (templates["leaderTemplate"], templates["workerTemplate"]):
        [vllm] = template["spec"]["containers"]
        assert arg(vllm["args"], "--load-format") == "modelstage_sharded_state"
        assert arg(vllm["args"], "--tensor-parallel-size") == "2"
        assert arg(vllm["args"], "--pipeline-parallel-size") == "2"
        assert {"name": "MODELSTAGE_DIGEST", "value": old} in vllm["env"]
        [prepare] = template["spec"]["initContainers"]
        assert prepare["command"][prepare["command"].index("--pp") + 1] == "2"
    assert "--headless" in templates["workerTemplate"]["spec"]["containers"][0]["args"]

    async def rolling() -> bool:  # the set's status, of the previous templates, is no roll
        status = await status_of(cluster, namespace)
        ready = condition(status, "Ready")
        return status.get("phase") == "RollingOut" and "0/1 updated" in ready.get("message", "")

    await eventually(rolling, what="RollingOut with 0/1 groups updated")

    await play_lws_controller(cluster.client, namespace)
    await wait_phase(cluster, namespace, "Ready")

    await cluster.client.patch(md_path(namespace, MD), {"spec": {"dtype": "float16"}})
    new = digest_of(merged(LWS_SPEC, {"dtype": "float16"}))
    await wait_job(cluster, namespace, new)
    await finish_stage_job(cluster.client, namespace, new, message=summary(new), succeeded=True)
    await wait_lws_on(cluster, namespace, new)

    await crash_looping_leader(cluster.client, namespace)
    status = await wait_phase(cluster, namespace, "Failed")
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RolledBack")
    assert (
        "CrashLoopBackOff" in degraded["message"] and "stage 1 unreachable" in degraded["message"]
    )
    assert (status["artifact"]["digest"], status["failedDigest"]) == (old, new)
    await wait_lws_on(cluster, namespace, old)
    await wait_event(cluster, namespace, "RolledBack", "Warning")
    assert operator.process is not None and operator.process.poll() is None
