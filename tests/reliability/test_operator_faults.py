"""Operator faults against a live ``kopf run`` process: killed mid-stage and mid-rollout at
varied moments, conflicting spec edits, and a target workload deleted or changed by someone
else.

Tier: the extended kmock API (tests/support/kube_fake.py) unless ``KUBEBUILDER_ASSETS``
names a real control plane (then that). kmock counts the operator's requests, which is how
"no duplicate Job, no double patch" is proven here; on the real tier the Job's uid and the
workload's generation prove it. Only the real tier shows: the API server's own validation of
the patches, garbage collection of Jobs, watch semantics under a restart (bookmarks, 410
Gone, a resourceVersion too old), and a Job controller's backoff (here the tests play the
Job controller, so "a Job that fails repeatedly" is one Job whose pods failed up to its
``backoffLimit``; the operator's side of it is
``test_failed_job_reports_the_termination_reason_and_creates_no_new_job`` in
tests/operator_live/test_operator_lifecycle.py, which this tier reuses by reference).
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from modelstage.operator.job_plan import stage_job_name
from support.api_gate import api_gate
from support.kube_cluster import Cluster, eventually, new_namespace
from support.modelstage_objects import (
    SPEC,
    complete_rollout,
    deploy_path,
    digest_of,
    finish_stage_job,
    job_path,
    md_path,
    merged,
    summary,
    template_digest,
    vllm_deployment,
)
from support.operator_flow import (
    MD,
    apply,
    condition,
    handled_deletion,
    handled_version,
    logged_more,
    operator_writes,
    staged_and_rolled,
    status_of,
    wait_job,
    wait_phase,
    wait_rolled,
    workload_events_handled,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio]
TRIALS = 10
STAGE_PHASES = ("before the Job", "Job running")
ROLLOUT_PHASES = ("before the patch", "after the patch")
SETTLE_S = [0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.5]
"""How long a "Job running" kill waits after the Job appeared: the operator may be writing
the status, handling the Job's event, or idle."""


async def fresh_namespace(cluster: Cluster) -> str:
    return await new_namespace(cluster, f"f-{uuid.uuid4().hex[:8]}")


async def one_job_one_patch(cluster: Cluster, ns: str, job_uid: str | None = None) -> None:
    jobs = await cluster.client.list(job_path(ns))
    assert len(jobs) == 1, [j["metadata"]["name"] for j in jobs]
    if job_uid is not None:
        assert jobs[0]["metadata"]["uid"] == job_uid
    workload = await cluster.client.get(deploy_path(ns))
    assert workload is not None and workload["metadata"]["generation"] == 2  # one template change
    if cluster.fake is not None:
        assert operator_writes(cluster, "POST", job_path(ns)) == 1
        assert operator_writes(cluster, "PATCH", deploy_path(ns)) == 1


async def phase_at_kill(cluster: Cluster, ns: str, digest: str) -> str:
    """Where a kill landed, read from the cluster right after it."""
    job = await cluster.client.get(job_path(ns, stage_job_name(digest)))
    if job is None:
        return "before the Job"
    if template_digest(await cluster.client.get(deploy_path(ns))) == digest:
        return "after the patch"
    return "before the patch" if (job.get("status") or {}).get("conditions") else "Job running"


async def killed_mid_stage(cluster: Cluster, tmp_path: Path, trial: int) -> str:
    """Kills the operator before it creates the Job (its POST held at the gate and never
    sent) or while the Job runs; odd trials finish the Job while the operator is down. It
    converges with one Job and one patch. Returns the phase the kill hit."""
    ns = await fresh_namespace(cluster)
    digest = digest_of(SPEC)
    target = STAGE_PHASES[trial % 2]
    async with api_gate(cluster) as gate:
        workdir = tmp_path / f"op-{trial}"
        workdir.mkdir()
        operator = OperatorProcess(gate.kubeconfig(workdir / "gated"), ns, workdir)
        create = gate.hold("POST", job_path(ns)) if target == "before the Job" else None
        await operator.start()
        try:
            await apply(cluster, ns, SPEC)
            if create is not None:
                await create.wait_arrived()
            else:
                await wait_job(cluster, ns, digest)
                await asyncio.sleep(SETTLE_S[trial % len(SETTLE_S)])
            await operator.kill()
            if create is not None:
                create.abandon()
            phase = await phase_at_kill(cluster, ns, digest)
            if trial % 2 and phase == "Job running":  # the stager finishes meanwhile
                await finish_stage_job(cluster.client, ns, digest, message=summary(digest),
                                       succeeded=True)  # fmt: skip
            await operator.start()
            job = await wait_job(cluster, ns, digest)
            if not (job.get("status") or {}).get("conditions"):
                await finish_stage_job(cluster.client, ns, digest, message=summary(digest),
                                       succeeded=True)  # fmt: skip
            await wait_rolled(cluster, ns, digest)
            await complete_rollout(cluster.client, ns)
            status = await wait_phase(cluster, ns, "Ready")
            assert status["artifact"]["digest"] == digest
            await one_job_one_patch(cluster, ns, job["metadata"]["uid"])
            return phase
        finally:
            await operator.stop(graceful=False)


async def killed_mid_rollout(cluster: Cluster, tmp_path: Path, trial: int) -> str:
    """Kills the operator when its workload patch is on the way (held at the gate, never
    sent) or has landed (its answer held): the restarted operator patches exactly once in
    all. Returns the phase the kill hit."""
    ns = await fresh_namespace(cluster)
    digest = digest_of(SPEC)
    target = ROLLOUT_PHASES[trial % 2]
    async with api_gate(cluster) as gate:
        workdir = tmp_path / f"op-{trial}"
        workdir.mkdir()
        operator = OperatorProcess(gate.kubeconfig(workdir / "gated"), ns, workdir)
        await operator.start()
        try:
            await apply(cluster, ns, SPEC)
            await wait_job(cluster, ns, digest)
            patch = gate.hold("PATCH", deploy_path(ns), after=target == "after the patch")
            await finish_stage_job(cluster.client, ns, digest, message=summary(digest),
                                   succeeded=True)  # fmt: skip
            await patch.wait_arrived()
            await operator.kill()
            patch.abandon()
            phase = await phase_at_kill(cluster, ns, digest)
            await operator.start()
            await wait_rolled(cluster, ns, digest)
            await complete_rollout(cluster.client, ns)
            await wait_phase(cluster, ns, "Ready")
            await one_job_one_patch(cluster, ns)
            return phase
        finally:
            await operator.stop(graceful=False)


@pytest.mark.timeout(120)
async def test_operator_killed_mid_stage_converges_with_one_job_and_one_patch(
    cluster: Cluster, tmp_path: Path
) -> None:
    phases = [await killed_mid_stage(cluster, tmp_path, trial) for trial in (0, 3)]
    assert phases == list(STAGE_PHASES)


@pytest.mark.timeout(120)
async def test_operator_killed_mid_rollout_converges_without_a_second_patch(
    cluster: Cluster, tmp_path: Path
) -> None:
    phases = [await killed_mid_rollout(cluster, tmp_path, trial) for trial in (0, 1)]
    assert phases == list(ROLLOUT_PHASES)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_ten_kills_mid_stage_at_varied_moments_each_converge_with_one_job_and_one_patch(
    cluster: Cluster, tmp_path: Path
) -> None:
    phases = [await killed_mid_stage(cluster, tmp_path, trial) for trial in range(TRIALS)]
    assert phases == [STAGE_PHASES[t % 2] for t in range(TRIALS)]


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_ten_kills_mid_rollout_at_varied_moments_each_converge_without_a_second_patch(
    cluster: Cluster, tmp_path: Path
) -> None:
    phases = [await killed_mid_rollout(cluster, tmp_path, trial) for trial in range(TRIALS)]
    assert phases == [ROLLOUT_PHASES[t % 2] for t in range(TRIALS)]


@pytest.mark.timeout(120)
async def test_conflicting_spec_edits_resolve_to_the_latest_generation(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    await apply(cluster, namespace, SPEC)
    edits = ["bfloat16", "float16", "float32", "bfloat16", "float16"]
    # racing writers: every edit lands while the operator works on the previous one
    for dtype in edits:
        await cluster.client.patch(md_path(namespace, MD), {"spec": {"dtype": dtype}})
        await asyncio.sleep(0.05)
    final = merged(SPEC, {"dtype": edits[-1]})
    digest = digest_of(final)
    body = await cluster.client.get(md_path(namespace, MD))
    assert body is not None
    generation = body["metadata"]["generation"]

    async def settled() -> dict[str, object] | None:
        status = (await cluster.client.get(md_path(namespace, MD)) or {}).get("status") or {}
        ok = (
            status.get("desiredDigest") == digest and status.get("observedGeneration") == generation
        )
        return status if ok else None

    await eventually(settled, timeout=30, what="the status on the latest generation")
    # The status is written before the Job is created (reconcile.py): wait for the Job too.
    await wait_job(cluster, namespace, digest)
    # jobs of stale generations may exist, but only the latest digest's Job is rolled out
    for job in await cluster.client.list(job_path(namespace)):
        d = job["metadata"]["labels"].get("modelstage.io/digest")
        await finish_stage_job(cluster.client, namespace, d, message=summary(d), succeeded=True)
    await wait_rolled(cluster, namespace, digest)
    await complete_rollout(cluster.client, namespace)
    status = await wait_phase(cluster, namespace, "Ready")
    assert status["artifact"]["digest"] == digest
    await workload_events_handled(cluster, operator, namespace)
    assert template_digest(await cluster.client.get(deploy_path(namespace))) == digest
    if cluster.fake is not None:
        assert operator_writes(cluster, "PATCH", deploy_path(namespace)) == 1


async def wait_generation(cluster: Cluster, ns: str, generation: int, digest: str) -> None:
    async def settled() -> dict[str, object] | None:
        status = (await cluster.client.get(md_path(ns, MD)) or {}).get("status") or {}
        ok = (
            status.get("desiredDigest") == digest and status.get("observedGeneration") == generation
        )
        return status if ok else None

    await eventually(settled, timeout=30, what=f"the status on generation {generation}")


@pytest.mark.timeout(120)
async def test_a_spec_edited_back_while_the_operator_works_on_a_newer_one_is_reconciled(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """The interleaving behind lost edits, made to happen every time by a gate in front of the
    API server. The handler woken by generation 2 (float16) reads generation 3 (bfloat16 again,
    whose Job exists: nothing to create) and writes its status; generation 4 (float16) lands
    before the handler returns. kopf compares generation 4 with the spec of the event that woke
    the handler (float16), sees no change, and calls no handler: only reconciling the status's
    lag behind the generation reaches generation 4."""
    ns = namespace
    first = merged(SPEC, {"dtype": "bfloat16"})
    async with api_gate(cluster) as gate:
        operator = OperatorProcess(gate.kubeconfig(tmp_path / "gated"), ns, tmp_path)
        await operator.start()
        try:
            await apply(cluster, ns, first)
            await wait_job(cluster, ns, digest_of(first))
            await wait_generation(cluster, ns, 1, digest_of(first))

            async def idle() -> bool:  # the Job's own event reconciles too: let it pass
                return operator.handled("stage_job_event")

            await eventually(idle, what="the Job's event handled")
            read = gate.hold("GET", md_path(ns, MD))
            await cluster.client.patch(md_path(ns, MD), {"spec": {"dtype": "float16"}})
            await read.wait_arrived()  # the handler of generation 2 reads the object...
            await cluster.client.patch(md_path(ns, MD), {"spec": {"dtype": "bfloat16"}})
            written = gate.hold("PATCH", md_path(ns, MD, "status"), after=True)
            read.release()  # ...and finds generation 3
            await written.wait_arrived()  # its status for generation 3 is written
            await cluster.client.patch(md_path(ns, MD), {"spec": {"dtype": "float16"}})
            written.release()
            await wait_generation(cluster, ns, 4, digest_of(merged(SPEC, {"dtype": "float16"})))
        finally:
            await operator.stop(graceful=False)


@pytest.mark.timeout(120)
async def test_a_deleted_target_workload_is_reported_and_not_recreated(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    digest = await staged_and_rolled(cluster, namespace, SPEC)
    workload = await cluster.client.get(deploy_path(namespace))
    assert workload is not None
    await cluster.client.delete(deploy_path(namespace))

    async def reported() -> dict[str, object] | None:
        status = (await cluster.client.get(md_path(namespace, MD)) or {}).get("status") or {}
        return status if condition(status, "Ready").get("reason") == "TargetNotFound" else None

    status = await eventually(reported, timeout=30, what="TargetNotFound in the status")
    assert status["artifact"]["digest"] == digest  # type: ignore[index]
    await handled_deletion(operator, workload["metadata"]["uid"], "deployment_event")
    assert await cluster.client.get(deploy_path(namespace)) is None
    if cluster.fake is not None:
        assert operator_writes(cluster, "POST", deploy_path(namespace, None)) == 0


@pytest.mark.timeout(120)
async def test_a_workload_edited_by_someone_else_keeps_their_edit(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Fields the operator does not own (image, replicas, other env) are theirs: an edit to
    them is not reverted and causes no patch."""
    digest = await staged_and_rolled(cluster, namespace, SPEC)
    workload = await cluster.client.get(deploy_path(namespace))
    assert workload is not None
    containers = workload["spec"]["template"]["spec"]["containers"]
    containers[0]["image"] = "vllm/vllm-openai:their-own-build"
    await cluster.client.patch(deploy_path(namespace), {
        "spec": {"replicas": 3, "template": {"spec": {"containers": containers}}}})  # fmt: skip
    await workload_events_handled(cluster, operator, namespace)
    after = await cluster.client.get(deploy_path(namespace))
    assert after is not None and template_digest(after) == digest
    assert after["spec"]["replicas"] == 3
    assert after["spec"]["template"]["spec"]["containers"][0]["image"].endswith("their-own-build")
    if cluster.fake is not None:
        assert operator_writes(cluster, "PATCH", deploy_path(namespace)) == 1


@pytest.mark.timeout(120)
async def test_a_workload_whose_artifact_fields_are_reverted_is_reported_not_repatched(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """A GitOps tool re-applying the original manifest strips the operator's fields; patching
    them back each time would restart the pods at every sync. Desired: one report, no fight."""
    await staged_and_rolled(cluster, namespace, SPEC)
    strip = {"spec": {"template": {"metadata": {"annotations": {
        "modelstage.io/artifact-digest": None}}}}}  # fmt: skip
    sync = {"metadata": {"labels": {"synced": "2"}}}  # the tool's next sync touches it again
    for edit in (strip, sync):
        await cluster.client.patch(deploy_path(namespace), edit)
        await workload_events_handled(cluster, operator, namespace)
    assert template_digest(await cluster.client.get(deploy_path(namespace))) is None
    status = (await cluster.client.get(md_path(namespace, MD)) or {}).get("status") or {}
    assert condition(status, "Degraded").get("status") == "True"
    if cluster.fake is not None:
        assert operator_writes(cluster, "PATCH", deploy_path(namespace)) == 1


@pytest.mark.timeout(120)
async def test_a_status_write_conflict_is_reread_and_retried(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """One 409 on the status write: the reconciliation re-reads and writes again (its own
    retry, ``reconcile.py``); the Job is created once."""
    ns = namespace
    async with api_gate(cluster) as gate:
        refused = gate.refuse("PATCH", md_path(ns, MD, "status"), 409, "Conflict")
        operator = OperatorProcess(gate.kubeconfig(tmp_path / "gated"), ns, tmp_path)
        await operator.start()
        try:
            await apply(cluster, ns, SPEC)
            await wait_job(cluster, ns, digest_of(SPEC))
            status = await wait_phase(cluster, ns, "Staging")
            assert refused.answered == 1
            assert status["desiredDigest"] == digest_of(SPEC)
            assert len(await cluster.client.list(job_path(ns))) == 1
            assert operator.count("failed temporarily") == 0
        finally:
            await operator.stop(graceful=False)


@pytest.mark.timeout(120)
async def test_conflicts_past_the_rereads_are_retried_by_kopf_after_a_delay(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """Three 409s in a row exhaust one reconciliation's re-reads: the spec handler fails
    temporarily ("the object kept changing") and kopf retries it after the conflict delay."""
    ns = namespace
    async with api_gate(cluster) as gate:
        refused = gate.refuse("PATCH", md_path(ns, MD, "status"), 409, "Conflict", times=3)
        operator = OperatorProcess(gate.kubeconfig(tmp_path / "gated"), ns, tmp_path, verbose=True)
        await operator.start()
        try:
            # The workload's first event, handled after the ModelDeployment is known, would
            # reconcile with re-reads of its own and could take some of the three 409s.
            await cluster.client.create(deploy_path(ns, None), vllm_deployment(model_deployment=MD))
            await workload_events_handled(cluster, operator, ns)
            await apply(cluster, ns, SPEC, workload=False)
            status = await wait_phase(cluster, ns, "Staging")
            assert refused.answered == 3
            # kopf logs the failure after the handler returns, and the Job's event may write
            # the status meanwhile: the line is awaited, not counted at once.
            await logged_more(operator, "failed temporarily: the object kept changing", 0)
            assert status["desiredDigest"] == digest_of(SPEC)
            await wait_job(cluster, ns, digest_of(SPEC))
            assert len(await cluster.client.list(job_path(ns))) == 1
        finally:
            await operator.stop(graceful=False)


RESYNC = "modeldeployment_resync"
LAGGING = "modeldeployment_lagging"
INVOKED = re.compile(r"^(?:Handler|Timer) '([^']+)' is invoked\.$")
OUTCOME = re.compile(r"^(?:Handler|Timer) '([^']+)' (?:succeeded|failed|raised)")


def invocations(records: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """``(index, object uid, handler)`` of each "is invoked" line (the verbose log)."""
    found = []
    for i, record in enumerate(records):
        invoked = INVOKED.match(record.get("message", ""))
        if invoked:
            found.append((i, str((record.get("object") or {}).get("uid")), invoked[1]))
    return found


def open_at(records: list[dict[str, Any]], index: int) -> set[tuple[str, str]]:
    """The handlers running (invoked, no outcome yet) when line ``index`` was logged."""
    running: set[tuple[str, str]] = set()
    for record in records[:index]:
        uid = str((record.get("object") or {}).get("uid"))
        message = record.get("message", "")
        if invoked := INVOKED.match(message):
            running.add((uid, invoked[1]))
        elif outcome := OUTCOME.match(message):
            running.discard((uid, outcome[1]))
    return running


async def operator_idle(cluster: Cluster, operator: OperatorProcess, ns: str) -> None:
    """Every event so far handled: the workload, the Job and its pods at their current
    versions (the handlers' trace), and then no handler but the timer running or invoked for
    a second (the ModelDeployment's own events, from its status writes, are not traced)."""
    await workload_events_handled(cluster, operator, ns)
    for job in await cluster.client.list(job_path(ns)):
        await handled_version(cluster, operator, job_path(ns, job["metadata"]["name"]),
                              "stage_job_event")  # fmt: skip
    for pod in await cluster.client.list(f"/api/v1/namespaces/{ns}/pods"):
        await handled_version(cluster, operator,
                              f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}",
                              "stager_pod_event")  # fmt: skip

    async def quiet() -> bool:
        records = operator.current_records()
        busy = {h for _, h in open_at(records, len(records))} - {RESYNC}
        cutoff = (datetime.now(UTC) - timedelta(seconds=1)).isoformat(timespec="microseconds")
        recent = [
            h for i, _, h in invocations(records)
            if h != RESYNC and records[i]["timestamp"] > cutoff
        ]  # fmt: skip
        return not busy and not recent

    await eventually(quiet, timeout=30, what="the operator idle (no handler but the timer)")


@pytest.mark.timeout(120)
async def test_the_resync_timer_alone_notices_a_deleted_workload(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """The Deployment's DELETED event is lost (the gate mutes that watch): only the timer
    (2 s here, 60 s by default) reconciles, and reports the workload gone. The operator is
    idle before the delete, and its verbose log shows that every status write from the
    delete to the report was made by the timer, and that nothing else ran before it."""
    ns = namespace
    async with api_gate(cluster) as gate:
        operator = OperatorProcess(
            gate.kubeconfig(tmp_path / "gated"), ns, tmp_path, verbose=True,
            extra_env={"MODELSTAGE_OPERATOR_RESYNC_INTERVAL": "2"},
        )  # fmt: skip
        await operator.start()
        try:
            await staged_and_rolled(cluster, ns, SPEC)
            await operator_idle(cluster, operator, ns)
            gate.mute(f"/apis/apps/v1/namespaces/{ns}/deployments")
            # Records are read from the start: a timer run that began just before the delete
            # and read the workload after it is the timer's write too (open_at sees it open).
            start = len(operator.current_records())
            await cluster.client.delete(deploy_path(ns))

            async def reported() -> bool:
                status = await status_of(cluster, ns)
                return condition(status, "Ready").get("reason") == "TargetNotFound"

            await eventually(reported, timeout=30, what="TargetNotFound from the timer")
            dropped = [json.loads(line) for line in gate.dropped if line.strip()]
            assert any(event["type"] == "DELETED" for event in dropped)  # never delivered
            records = operator.current_records()
            write = f'"PATCH {md_path(ns, MD, "status")} HTTP/1.1" 200'
            writes = [
                i for i, r in enumerate(records) if i >= start and write in r.get("message", "")
            ]
            assert writes, "the status changed without a status write in the operator's log"
            # The lag handler sees the ModelDeployment's own events (the timer's status
            # writes) and acts only on a lag, of which there is none (observedGeneration is
            # the generation): every status write happened inside a run of the timer's.
            before = [h for i, _, h in invocations(records) if start <= i < writes[0]]
            assert set(before) <= {RESYNC, LAGGING}, (
                f"ran between the delete and the report: {before}"
            )
            md = await cluster.client.get(md_path(ns, MD)) or {}
            assert md["status"]["observedGeneration"] == md["metadata"]["generation"]
            uid = md["metadata"]["uid"]
            for i in writes:
                running = open_at(records, i)
                assert (uid, RESYNC) in running, records[i]["timestamp"]
                assert running <= {(uid, RESYNC), (uid, LAGGING)}, records[i]["timestamp"]
        finally:
            await operator.stop(graceful=False)


@pytest.mark.timeout(120)
async def test_a_job_event_whose_reconciliation_keeps_conflicting_still_rolls_out(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """The Job's success is seen only through its own events (kopf does not retry event
    handlers, and those events do not repeat): eight 409s on the status write, more than the
    re-reads of every reconciliation the events wake, must not drop the roll-out."""
    ns = namespace
    digest = digest_of(SPEC)
    async with api_gate(cluster) as gate:
        operator = OperatorProcess(gate.kubeconfig(tmp_path / "gated"), ns, tmp_path, verbose=True)
        await operator.start()
        try:
            await apply(cluster, ns, SPEC)
            await wait_job(cluster, ns, digest)
            await handled_version(cluster, operator, job_path(ns, stage_job_name(digest)),
                                  "stage_job_event")  # fmt: skip
            refused = gate.refuse("PATCH", md_path(ns, MD, "status"), 409, "Conflict", times=8)
            await finish_stage_job(cluster.client, ns, digest, message=summary(digest),
                                   succeeded=True)  # fmt: skip
            await wait_rolled(cluster, ns, digest)
            assert refused.answered == 8
        finally:
            await operator.stop(graceful=False)
