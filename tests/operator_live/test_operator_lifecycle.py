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
from pathlib import Path
from typing import Any

import pytest
from modelstage.operator.job_plan import stage_job_name
from support.charts import render_docs as chart_docs
from support.kube_cluster import (
    ApiStatusError,
    Cluster,
    create_all,
    eventually,
    operator_kubeconfig,
)
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
)
from support.operator_flow import (
    MD,
    OPERATOR_AGENT,
    apply,
    condition,
    handled_version,
    logged_more,
    operator_writes,
    spec_handled,
    staged_and_rolled,
    status_of,
    wait_event,
    wait_job,
    wait_phase,
    wait_rolled,
    workload_events_handled,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]


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
        "ModelDeployment",
        MD,
        md["metadata"]["uid"],
        True,
    )
    status = await wait_phase(cluster, namespace, "Staging")
    assert status["desiredDigest"] == digest
    assert status["observedGeneration"] == md["metadata"]["generation"]
    assert condition(status, "Staged")["status"] == "False"
    assert "--digest" in job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert (
        job["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.test/modelstage/stager:test"
    )
    # The workload is untouched until the artifact is complete.
    assert template_digest(await cluster.client.get(deploy_path(namespace))) is None


async def test_succeeded_job_rolls_the_workload_onto_the_artifact_and_reports_its_source(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SPEC)
    digest = digest_of(SPEC)
    await wait_job(cluster, namespace, digest)
    await finish_stage_job(
        cluster.client,
        namespace,
        digest,
        message=summary(digest, source="sha:feedface"),
        succeeded=True,
    )
    status = await wait_phase(cluster, namespace, "RollingOut")
    artifact = status["artifact"]
    assert (artifact["digest"], artifact["source"], artifact["bytes"]) == (
        digest,
        "sha:feedface",
        123456,
    )
    assert artifact["uri"] == f"pvc://models/artifacts/{namespace}/{digest}"
    assert condition(status, "Staged")["status"] == "True"
    workload = await wait_rolled(cluster, namespace, digest)
    [vllm] = workload["spec"]["template"]["spec"]["containers"]
    assert f"/mnt/modelstage/artifacts/artifacts/{namespace}/{digest}" in vllm["args"]
    assert [c["name"] for c in workload["spec"]["template"]["spec"]["initContainers"]] == [
        "modelstage-prepare"
    ]

    await complete_rollout(cluster.client, namespace)
    status = await wait_phase(cluster, namespace, "Ready")
    assert condition(status, "Ready")["status"] == "True"
    for reason in ("JobCreated", "RolledOut", "PhaseStaging", "PhaseRollingOut", "PhaseReady"):
        await wait_event(cluster, namespace, reason)


async def test_failed_job_reports_the_termination_reason_and_creates_no_new_job(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SPEC)
    digest = digest_of(SPEC)
    await wait_job(cluster, namespace, digest)
    reason = "CheckpointError: model.safetensors.index.json names shard 3 but it is missing"
    await finish_stage_job(
        cluster.client, namespace, digest, message=f"loading\n{reason}\n", succeeded=False
    )
    status = await wait_phase(cluster, namespace, "Failed")
    staged = condition(status, "Staged")
    assert (staged["status"], staged["reason"], staged["message"]) == (
        "False",
        "StagingFailed",
        reason,
    )
    assert condition(status, "Degraded")["reason"] == "StagingFailed"
    await wait_event(cluster, namespace, "StagingFailed", "Warning")
    # The failed Job's event is handled: the artifact's Job stays the failed one, no retry
    # storm of new Jobs (a spec change or deleting the Job stages again).
    await handled_version(cluster, operator, job_path(namespace, stage_job_name(digest)),
                          "stage_job_event")  # fmt: skip
    jobs = await cluster.client.list(job_path(namespace))
    assert [j["metadata"]["name"] for j in jobs] == [stage_job_name(digest)]
    assert template_digest(await cluster.client.get(deploy_path(namespace))) is None
    if cluster.fake is not None:
        assert operator_writes(cluster, "POST", job_path(namespace)) == 1
        md_reads = cluster.fake.writes("GET", md_path(namespace, MD), agent=OPERATOR_AGENT)
        assert md_reads <= 8, f"{md_reads} reconciliations for one failure: a retry storm"


async def test_spec_change_stages_a_new_job_while_the_workload_keeps_the_old_artifact(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    old = await staged_and_rolled(cluster, namespace, SPEC)
    new_spec = merged(SPEC, {"dtype": "bfloat16"})
    new = digest_of(new_spec)
    assert new != old
    await cluster.client.patch(md_path(namespace, MD), {"spec": {"dtype": "bfloat16"}})
    await wait_job(cluster, namespace, new)
    status = await wait_phase(cluster, namespace, "Staging")
    assert status["desiredDigest"] == new
    assert status["artifact"]["digest"] == old
    await spec_handled(cluster, namespace, {"dtype": "bfloat16"})
    assert template_digest(await cluster.client.get(deploy_path(namespace))) == old

    await finish_stage_job(cluster.client, namespace, new, message=summary(new), succeeded=True)

    async def rolled() -> bool:
        return template_digest(await cluster.client.get(deploy_path(namespace))) == new

    await eventually(rolled, what="the workload on the new artifact")
    status = await wait_phase(cluster, namespace, "RollingOut")
    assert (status["artifact"]["digest"], status["previousArtifact"]["digest"]) == (new, old)


async def test_crash_looping_pods_roll_the_workload_back_to_the_previous_artifact(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    old = await staged_and_rolled(cluster, namespace, SPEC)
    await cluster.client.patch(md_path(namespace, MD), {"spec": {"dtype": "float16"}})
    new = digest_of(merged(SPEC, {"dtype": "float16"}))
    await wait_job(cluster, namespace, new)
    await finish_stage_job(cluster.client, namespace, new, message=summary(new), succeeded=True)
    await wait_rolled(cluster, namespace, new)

    await crash_looping_pod(cluster.client, namespace, new)

    status = await wait_phase(cluster, namespace, "Failed")
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RolledBack")
    assert "CrashLoopBackOff" in degraded["message"] and "CUDA out of memory" in degraded["message"]
    assert (status["artifact"]["digest"], status["failedDigest"]) == (old, new)
    await wait_rolled(cluster, namespace, old)
    await wait_event(cluster, namespace, "RolledBack", "Warning")
    # The failed digest is not rolled out again: once the rollback's own event is handled...
    await workload_events_handled(cluster, operator, namespace)
    assert template_digest(await cluster.client.get(deploy_path(namespace))) == old


async def test_operator_killed_mid_stage_resumes_without_a_second_job_or_patch(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SPEC)
    digest = digest_of(SPEC)
    job = await wait_job(cluster, namespace, digest)
    await wait_phase(cluster, namespace, "Staging")
    await operator.kill()
    # The stager finishes while the operator is down.
    await finish_stage_job(
        cluster.client, namespace, digest, message=summary(digest), succeeded=True
    )
    await operator.start()

    await wait_rolled(cluster, namespace, digest)
    await complete_rollout(cluster.client, namespace)
    await wait_phase(cluster, namespace, "Ready")
    jobs = await cluster.client.list(job_path(namespace))
    assert [j["metadata"]["uid"] for j in jobs] == [job["metadata"]["uid"]]
    workload = await cluster.client.get(deploy_path(namespace))
    assert workload is not None and workload["metadata"]["generation"] == 2  # one template change
    if cluster.fake is not None:
        assert operator_writes(cluster, "POST", job_path(namespace)) == 1
        assert operator_writes(cluster, "PATCH", deploy_path(namespace)) == 1


async def test_operator_killed_mid_rollout_resumes_without_patching_the_workload_again(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SPEC)
    digest = digest_of(SPEC)
    await wait_job(cluster, namespace, digest)
    await finish_stage_job(
        cluster.client, namespace, digest, message=summary(digest), succeeded=True
    )
    before = await wait_rolled(cluster, namespace, digest)
    await operator.kill()
    await operator.start()
    # The restarted operator reconciles on resume (kopf's on.resume), then the rollout completes.
    await eventually(
        lambda: asyncio.sleep(0, result=operator.handled("modeldeployment_changed")),
        what="the reconciliation on resume",
    )
    await complete_rollout(cluster.client, namespace)
    await wait_phase(cluster, namespace, "Ready")
    after = await cluster.client.get(deploy_path(namespace))
    assert after is not None
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"]["template"] == before["spec"]["template"]
    if cluster.fake is not None:
        assert operator_writes(cluster, "PATCH", deploy_path(namespace)) == 1
        assert operator_writes(cluster, "POST", job_path(namespace)) == 1


async def test_digest_preserving_edit_stages_nothing(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    digest = await staged_and_rolled(cluster, namespace, SPEC)
    md = await cluster.client.patch(
        md_path(namespace, MD),
        {
            "spec": {
                "retention": {"keep": 3},
                "stager": {"resources": {"limits": {"memory": "4Gi"}}},
            }
        },
    )
    assert digest_of(md["spec"]) == digest

    async def observed() -> dict[str, Any] | None:
        status = await status_of(cluster, namespace)
        return status if status.get("observedGeneration") == md["metadata"]["generation"] else None

    status = await eventually(observed, what="the edit observed")
    assert status["phase"] == "Ready" and status["artifact"]["digest"] == digest
    jobs = await cluster.client.list(job_path(namespace))
    assert [j["metadata"]["name"] for j in jobs] == [stage_job_name(digest)]
    assert template_digest(await cluster.client.get(deploy_path(namespace))) == digest
    if cluster.fake is not None:
        assert operator_writes(cluster, "PATCH", deploy_path(namespace)) == 1


async def test_spec_that_can_never_work_fails_permanently_with_an_actionable_reason(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    spec = merged(SPEC, {"serving": {"vllmVersion": "0.1"}})
    await apply(cluster, namespace, spec)
    status = await wait_phase(cluster, namespace, "Failed")
    staged = condition(status, "Staged")
    assert staged["reason"] == "UnsupportedVllmVersion"
    assert "vllmVersion" in staged["message"]
    # kopf's own line for a PermanentError, with the same reason as the status.
    permanent = f"Handler 'modeldeployment_changed' failed permanently: {staged['message']}"
    await logged_more(operator, permanent, 0)
    assert await cluster.client.list(job_path(namespace)) == []


async def test_metrics_count_reconciles_jobs_by_state_and_deployments_by_phase(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SPEC)
    digest = digest_of(SPEC)
    await wait_job(cluster, namespace, digest)
    await finish_stage_job(
        cluster.client, namespace, digest, message=summary(digest), succeeded=True
    )
    await wait_rolled(cluster, namespace, digest)

    async def scraped() -> str | None:
        text = await operator.scrape()
        wanted = (
            'modelstage_operator_stage_jobs{state="Succeeded"} 1.0',
            'modelstage_operator_model_deployments{phase="RollingOut"} 1.0',
            "modelstage_operator_stage_jobs_created_total 1.0",
            'modelstage_operator_workload_patches_total{action="roll-out"} 1.0',
        )
        return text if all(w in text for w in wanted) else None

    text = await eventually(scraped, what="the metrics")
    ok = [
        line
        for line in text.splitlines()
        if line.startswith('modelstage_operator_reconciles_total{result="ok"}')
    ]
    assert ok and float(ok[0].split()[-1]) >= 2


async def test_deleting_the_model_deployment_garbage_collects_its_job(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """Owner references at work: kube-controller-manager's garbage collector on the real tier,
    the fake's copy of it on kmock."""
    assert cluster.garbage_collection, "KUBEBUILDER_ASSETS must hold kube-controller-manager"
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path)
    await operator.start()
    try:
        await apply(cluster, namespace, SPEC)
        digest = digest_of(SPEC)
        await wait_job(cluster, namespace, digest)
        await cluster.client.delete(md_path(namespace, MD))

        async def collected() -> bool:
            return await cluster.client.get(job_path(namespace, stage_job_name(digest))) is None

        await eventually(collected, timeout=30, what="the Job garbage-collected")
    finally:
        await operator.stop(graceful=False)


async def test_a_model_deployment_with_a_100_character_name_stages_and_rolls(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Object names may have 253 characters, label values 63: the Job's owner label must fit
    (the real API server refuses the Job otherwise)."""
    name = "llama-" + "x" * 93 + "1"
    assert len(name) == 100
    digest = await staged_and_rolled(cluster, namespace, SPEC, name=name)
    job = await cluster.client.get(job_path(namespace, stage_job_name(digest)))
    assert job is not None
    owner_label = job["metadata"]["labels"]["modelstage.io/model-deployment"]
    assert len(owner_label) <= 63 and owner_label.startswith("llama-x")
    assert job["metadata"]["ownerReferences"][0]["name"] == name


async def test_the_operator_as_the_chart_runs_it_serves_every_namespace(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """``python -m modelstage.operator`` with the chart's arguments (``--all-namespaces``,
    peering on) and, on the real tier, the chart's ClusterRole only: it starts, stays up and
    stages."""
    docs = chart_docs("--set", "watch.namespaced=false")
    if cluster.tier == "real":
        await create_all(cluster.client, [d for d in docs if d["kind"] == "ClusterKopfPeering"])
        kubeconfig = await operator_kubeconfig(
            cluster.client, cluster.server, docs, tmp_path / "clusterwide-kubeconfig"
        )
    else:
        await cluster.client.create("/apis/kopf.dev/v1/clusterkopfpeerings",
                                    {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                     "metadata": {"name": "modelstage"}})  # fmt: skip
        kubeconfig = cluster.kubeconfig
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = [a for a in container["args"] if not a.startswith("--liveness")]
    assert "--all-namespaces" in args and any(a.startswith("--priority") for a in args)
    operator = OperatorProcess(kubeconfig, namespace, tmp_path, args=args)
    await operator.start()
    try:
        await apply(cluster, namespace, SPEC)
        await wait_job(cluster, namespace, digest_of(SPEC))
        assert operator.process is not None and operator.process.poll() is None
        assert "Forbidden" not in operator.logs()
    finally:
        await operator.stop(graceful=False)


async def test_a_pipelined_model_deployment_stages_with_pp_and_rolls_vllms_pipeline_size(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """``parallelism.pipeline: 2`` passes the real API server's CRD validation, reaches the
    stager Job as ``--pp 2`` and the workload as ``--pipeline-parallel-size 2`` and
    ``prepare --pp 2``; the status records the artifact's PP for a rollback."""
    spec = merged(SPEC, {"parallelism": {"tensor": 1, "pipeline": 2}})
    await apply(cluster, namespace, spec)
    digest = digest_of(spec)
    assert digest != digest_of(SPEC)
    job = await wait_job(cluster, namespace, digest)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--pp") + 1] == "2"
    await finish_stage_job(cluster.client, namespace, digest, message=summary(digest),
                           succeeded=True)  # fmt: skip
    status = await wait_phase(cluster, namespace, "RollingOut")
    assert status["artifact"]["pipelineParallelSize"] == 2
    workload = await wait_rolled(cluster, namespace, digest)
    [vllm] = workload["spec"]["template"]["spec"]["containers"]
    assert vllm["args"][vllm["args"].index("--pipeline-parallel-size") + 1] == "2"
    [prepare] = workload["spec"]["template"]["spec"]["initContainers"]
    assert prepare["command"][prepare["command"].index("--pp") + 1] == "2"


async def test_a_layer_partition_is_staged_recorded_and_set_for_vllm(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """``parallelism.layerPartition`` passes the CRD's rule, reaches the stager Job as
    ``--pp-layer-partition``, is recorded in the status and set on the vLLM container as
    ``VLLM_PP_LAYER_PARTITION``; on the real API server a partition with the wrong number of
    stages is refused by the CRD's CEL rule before anything is created."""
    if cluster.fake is None:
        wrong = merged(SPEC, {"parallelism": {"tensor": 1, "pipeline": 2, "layerPartition": [4, 2, 2]}})
        with pytest.raises(ApiStatusError) as refused:
            await cluster.client.create(md_path(namespace), model_deployment("wrong", wrong))
        assert refused.value.status == 422
        assert "one layer count per pipeline stage" in str(refused.value.body)
    spec = merged(SPEC, {"parallelism": {"tensor": 1, "pipeline": 2, "layerPartition": [3, 5]}})
    await apply(cluster, namespace, spec)
    digest = digest_of(spec)
    assert digest != digest_of(merged(SPEC, {"parallelism": {"tensor": 1, "pipeline": 2}}))
    job = await wait_job(cluster, namespace, digest)
    assert "--pp-layer-partition=3,5" in job["spec"]["template"]["spec"]["containers"][0]["command"]
    await finish_stage_job(cluster.client, namespace, digest, message=summary(digest),
                           succeeded=True)  # fmt: skip
    status = await wait_phase(cluster, namespace, "RollingOut")
    assert status["artifact"]["layerPartition"] == [3, 5]
    workload = await wait_rolled(cluster, namespace, digest)
    [vllm] = workload["spec"]["template"]["spec"]["containers"]
    assert {"name": "VLLM_PP_LAYER_PARTITION", "value": "3,5"} in vllm["env"]
