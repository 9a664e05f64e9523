"""A moving source through the operator (tier: kmock, or the real control plane when
``KUBEBUILDER_ASSETS`` is set): a branch is resolved by a Job before any digest exists, the
stage Job is pinned to what was resolved, and a branch that moved is resolved again, staged as a
new artifact while the old one serves, and rolled out. The tests play the Job controller and
the kubelet (the resolve pod's termination message carries ``modelstage resolve``'s line).

Only the real tier proves: that the API server serves the printer columns as ``kubectl get
md -o wide`` shows them (server-side Table printing, which kmock does not emulate).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from modelstage.api.modeldeployment import ModelDeploymentSpec, SourceStatus
from modelstage.operator.resolve_plan import resolve_job_name
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
    template_digest,
)
from support.operator_flow import (
    MD,
    apply,
    condition,
    events_for,
    staged_and_rolled,
    status_of,
    wait_job,
    wait_named_job,
    wait_phase,
    wait_rolled,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
BRANCH = merged(SPEC, {"model": {"revision": "main"}})
COMMIT_A, COMMIT_B = "a1" * 20, "b2" * 20


def resolution(commit: str) -> str:
    return json.dumps({"uri": BRANCH["model"]["uri"], "revision": "main", "kind": "hf",
                       "identity": f"commit:{commit}", "commit": commit})  # fmt: skip


def staged(digest: str, commit: str) -> str:
    """The stager's summary of an artifact staged at ``commit``."""
    return json.dumps({"digest": digest, "source": BRANCH["model"]["uri"], "bytes": 4096,
                       "sourceIdentity": f"commit:{commit}", "files": 4, "seconds": 2.0})  # fmt: skip


async def resolve_job(cluster: Cluster, ns: str) -> dict[str, Any]:
    """This round's resolve Job: named after the spec and the last resolution in the status."""
    status = await status_of(cluster, ns)
    recorded = SourceStatus.model_validate(status["source"]) if status.get("source") else None
    name = resolve_job_name(ModelDeploymentSpec.model_validate(BRANCH), recorded, MD)
    return await wait_named_job(cluster, ns, name)


async def finish_resolve(
    cluster: Cluster, ns: str, job: dict[str, Any], message: str, *, succeeded: bool = True
) -> None:
    await finish_stage_job(cluster.client, ns, "", message=message, succeeded=succeeded,
                           job_name=job["metadata"]["name"], container="resolve")  # fmt: skip


async def wait_source(cluster: Cluster, ns: str, identity: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        status = await status_of(cluster, ns)
        return status if (status.get("source") or {}).get("identity") == identity else None

    return await eventually(probe, what=f"status.source {identity}")


async def test_a_branch_is_resolved_by_a_job_and_staged_at_the_commit_it_named(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, BRANCH)
    job = await resolve_job(cluster, namespace)
    md = await cluster.client.get(md_path(namespace, MD))
    assert md is not None
    assert [o["uid"] for o in job["metadata"]["ownerReferences"]] == [md["metadata"]["uid"]]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["modelstage", "resolve", BRANCH["model"]["uri"]]
    assert container["command"][3:] == ["--revision=main"]
    status = await wait_phase(cluster, namespace, "Pending")
    assert status["reason"] == "Resolving" and "desiredDigest" not in status
    assert condition(status, "Staged")["reason"] == "Resolving"
    assert await cluster.client.list(job_path(namespace), labelSelector=(
        "app.kubernetes.io/component=stager")) == []  # nothing staged before the identity  # fmt: skip

    await finish_resolve(cluster, namespace, job, resolution(COMMIT_A))
    digest = digest_of(BRANCH, f"commit:{COMMIT_A}")
    stage = await wait_job(cluster, namespace, digest)
    command = stage["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--revision={COMMIT_A}" in command
    assert f"--expect-identity=commit:{COMMIT_A}" in command
    status = await wait_source(cluster, namespace, f"commit:{COMMIT_A}")
    assert status["source"]["commit"] == COMMIT_A and status["source"]["resolvedAt"]
    assert status["desiredDigest"] == digest

    await finish_stage_job(cluster.client, namespace, digest, message=staged(digest, COMMIT_A),
                           succeeded=True)  # fmt: skip
    await wait_rolled(cluster, namespace, digest)
    await complete_rollout(cluster.client, namespace)
    status = await wait_phase(cluster, namespace, "Ready")
    assert status["artifact"]["source"] == f"commit:{COMMIT_A}"
    assert status["reason"] == "Serving"
    reasons = {e["reason"] for e in await events_for(cluster, namespace)}
    assert {"ResolveJobCreated", "Resolving", "JobCreated"} <= reasons


async def test_a_failed_resolution_fails_with_its_reason_and_stages_nothing(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, BRANCH)
    job = await resolve_job(cluster, namespace)
    why = "error: hf://acme/tiny-llama: revision 'main' not found (a branch, tag or commit sha)"
    await finish_resolve(cluster, namespace, job, why, succeeded=False)
    status = await wait_phase(cluster, namespace, "Failed")
    assert status["reason"] == "ResolveFailed"
    assert why in condition(status, "Staged")["message"]
    assert condition(status, "Degraded")["status"] == "True"
    assert await cluster.client.list(job_path(namespace), labelSelector=(
        "app.kubernetes.io/component=stager")) == []  # fmt: skip


async def test_a_source_that_changed_before_its_stage_job_ran_is_resolved_again(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """The stage Job refuses a source that no longer has the resolved identity; the operator
    resolves it again at once (no interval set) and stages what the source holds now."""
    await apply(cluster, namespace, BRANCH)
    await finish_resolve(cluster, namespace, await resolve_job(cluster, namespace),
                         resolution(COMMIT_A))  # fmt: skip
    stale = digest_of(BRANCH, f"commit:{COMMIT_A}")
    await wait_job(cluster, namespace, stale)
    refusal = (f"error: {BRANCH['model']['uri']} changed since it was resolved: expected source "
               f"identity commit:{COMMIT_A}, found commit:{COMMIT_B}; resolve it again")  # fmt: skip
    await finish_stage_job(cluster.client, namespace, stale, message=refusal, succeeded=False)
    await finish_resolve(cluster, namespace, await resolve_job(cluster, namespace),
                         resolution(COMMIT_B))  # fmt: skip
    fresh = digest_of(BRANCH, f"commit:{COMMIT_B}")
    await wait_job(cluster, namespace, fresh)
    await finish_stage_job(cluster.client, namespace, fresh, message=staged(fresh, COMMIT_B),
                           succeeded=True)  # fmt: skip
    await wait_rolled(cluster, namespace, fresh)
    await complete_rollout(cluster.client, namespace)
    status = await wait_phase(cluster, namespace, "Ready")
    assert status["artifact"]["source"] == f"commit:{COMMIT_B}"


@pytest_asyncio.fixture
async def resolving(cluster: Cluster, namespace: str, tmp_path: Path) -> AsyncIterator[None]:
    """An operator that resolves moving sources every 2 s and re-reads every second (the
    timer, not an event, notices that a resolution is due)."""
    process = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, extra_env={
        "MODELSTAGE_OPERATOR_RESOLVE_INTERVAL": "2",
        "MODELSTAGE_OPERATOR_RESYNC_INTERVAL": "1",
    })  # fmt: skip
    await process.start()
    try:
        yield
    finally:
        await process.stop(graceful=False)


async def test_a_moved_branch_is_resolved_again_staged_anew_and_rolled_out(
    cluster: Cluster, namespace: str, resolving: None
) -> None:
    await apply(cluster, namespace, BRANCH)
    await finish_resolve(cluster, namespace, await resolve_job(cluster, namespace),
                         resolution(COMMIT_A))  # fmt: skip
    old = digest_of(BRANCH, f"commit:{COMMIT_A}")
    await wait_job(cluster, namespace, old)
    await finish_stage_job(cluster.client, namespace, old, message=staged(old, COMMIT_A),
                           succeeded=True)  # fmt: skip
    await wait_rolled(cluster, namespace, old)
    await complete_rollout(cluster.client, namespace)
    await wait_phase(cluster, namespace, "Ready")

    # main moves; the next round (due 2 s after the last) finds the new commit.
    await finish_resolve(cluster, namespace, await resolve_job(cluster, namespace),
                         resolution(COMMIT_B))  # fmt: skip
    new = digest_of(BRANCH, f"commit:{COMMIT_B}")
    assert new != old
    await wait_job(cluster, namespace, new)
    status = await wait_source(cluster, namespace, f"commit:{COMMIT_B}")
    assert status["desiredDigest"] == new
    assert status["artifact"]["digest"] == old  # stage before roll: the old one serves
    assert template_digest(await cluster.client.get(deploy_path(namespace))) == old

    await finish_stage_job(cluster.client, namespace, new, message=staged(new, COMMIT_B),
                           succeeded=True)  # fmt: skip
    await wait_rolled(cluster, namespace, new)
    await complete_rollout(cluster.client, namespace)
    status = await wait_phase(cluster, namespace, "Ready")
    assert (status["artifact"]["digest"], status["artifact"]["source"]) == (
        new, f"commit:{COMMIT_B}")  # fmt: skip
    assert status["previousArtifact"]["digest"] == old


async def test_kubectl_get_shows_state_at_a_glance(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """``kubectl get md -o wide``: the API server's Table for the CRD's printer columns."""
    if cluster.fake is not None:
        pytest.skip("server-side Table printing is kube-apiserver's: the real tier proves it")
    digest = await staged_and_rolled(cluster, namespace, SPEC)
    assert cluster.client.session is not None
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io"
    async with cluster.client.session.get(md_path(namespace), headers={"Accept": accept}) as r:
        assert r.status == 200, await r.text()
        table = await r.json()
    assert table["kind"] == "Table"
    columns = [(c["name"], c.get("priority", 0)) for c in table["columnDefinitions"]]
    assert columns == [
        ("Name", 0), ("Phase", 0), ("Ready", 0), ("Reason", 0), ("Model", 0), ("TP", 0),
        ("Age", 0), ("Target", 1), ("Format", 1), ("Digest", 1), ("Source", 1),
    ]  # fmt: skip
    (row,) = table["rows"]
    cells = dict(zip([name for name, _ in columns], row["cells"], strict=True))
    assert cells["Name"] == MD
    assert (cells["Phase"], cells["Ready"], cells["Reason"]) == ("Ready", "True", "Serving")
    assert (cells["Model"], cells["TP"]) == (SPEC["model"]["uri"], 1)
    assert (cells["Target"], cells["Format"], cells["Digest"]) == ("vllm", "sharded_state", digest)
