"""Steps of the live operator tests (apply, wait for a Job, a phase, a rollout; count the
operator's writes), shared by the lifecycle, scale-out, limits and reliability suites."""

from __future__ import annotations

import json
from typing import Any

from modelstage.api.modeldeployment import GROUP
from modelstage.operator.job_plan import stage_job_name

from support.kube_cluster import Cluster, eventually
from support.modelstage_objects import (
    complete_rollout,
    deploy_path,
    digest_of,
    finish_stage_job,
    job_path,
    md_path,
    model_deployment,
    summary,
    template_digest,
    vllm_deployment,
)
from support.operator_process import OperatorProcess

MD = "llama"
OPERATOR_AGENT = "OpenAPI-Generator"
"""The handlers' client (kubernetes package); kopf's own requests say ``kopf/...``."""
LAST_HANDLED = f"{GROUP}/last-handled-configuration"
"""Where kopf keeps the spec its change handlers last handled to success (``settings.py``)."""


async def status_of(cluster: Cluster, ns: str, name: str = MD) -> dict[str, Any]:
    body = await cluster.client.get(md_path(ns, name)) or {}
    status: dict[str, Any] = body.get("status") or {}
    return status


async def wait_phase(
    cluster: Cluster, ns: str, phase: str, timeout: float = 60.0, name: str = MD
) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        status = await status_of(cluster, ns, name)
        return status if status.get("phase") == phase else None

    return await eventually(probe, timeout=timeout, what=f"phase {phase}")


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


async def events_for(cluster: Cluster, ns: str, name: str = MD) -> list[dict[str, Any]]:
    events = await cluster.client.list(f"/api/v1/namespaces/{ns}/events")
    return [e for e in events if (e.get("involvedObject") or {}).get("name") == name]


async def apply(
    cluster: Cluster, ns: str, spec: dict[str, Any], *, workload: bool = True, name: str = MD
) -> None:
    if workload:  # opted in for this ModelDeployment
        await cluster.client.create(deploy_path(ns, None), vllm_deployment(model_deployment=name))
    await cluster.client.create(md_path(ns), model_deployment(name, spec))


async def wait_named_job(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        return await cluster.client.get(job_path(ns, name))

    return await eventually(probe, what=f"Job {name}")


async def wait_job(cluster: Cluster, ns: str, digest: str) -> dict[str, Any]:
    """The stager Job of ``digest``."""
    return await wait_named_job(cluster, ns, stage_job_name(digest))


async def wait_rolled(cluster: Cluster, ns: str, digest: str) -> dict[str, Any]:
    """The workload's template on ``digest`` (the status is written before the patch)."""

    async def probe() -> dict[str, Any] | None:
        workload = await cluster.client.get(deploy_path(ns))
        return workload if template_digest(workload) == digest else None

    return await eventually(probe, what=f"the workload on {digest}")


async def wait_event(
    cluster: Cluster, ns: str, reason: str, type_: str = "Normal"
) -> dict[str, Any]:
    """kopf posts Events asynchronously, after the status write."""

    async def probe() -> dict[str, Any] | None:
        events = await events_for(cluster, ns)
        return next((e for e in events if (e["reason"], e["type"]) == (reason, type_)), None)

    return await eventually(probe, what=f"a {type_} Event {reason}")


async def staged_and_rolled(cluster: Cluster, ns: str, spec: dict[str, Any], name: str = MD) -> str:
    """Applies ``spec``, completes its Job and the rollout: the workload is Ready on it."""
    await apply(cluster, ns, spec, name=name)
    digest = digest_of(spec)
    await wait_job(cluster, ns, digest)
    await finish_stage_job(cluster.client, ns, digest, message=summary(digest), succeeded=True)
    await wait_rolled(cluster, ns, digest)
    await complete_rollout(cluster.client, ns)
    await wait_phase(cluster, ns, "Ready", name=name)
    return digest


async def logged_more(operator: OperatorProcess, text: str, than: int, times: int = 1) -> None:
    """The operator has logged ``text`` ``times`` more times than ``than`` (a count taken
    before). Evidence only for a line that nothing but the event under test writes (a
    failure's own message): a handler's "succeeded" line may come from any leftover event,
    which ``handled_version`` and ``handled_deletion`` tell apart."""

    async def probe() -> bool:
        return operator.count(text) >= than + times

    await eventually(probe, timeout=60, what=f"{times} more {text!r} in the operator's log")


def succeeded(handler: str) -> str:
    return f"Handler '{handler}' succeeded."


def _uid(record: dict[str, Any]) -> str | None:
    ref = record.get("object")
    return ref.get("uid") if isinstance(ref, dict) else None


def ran_on(records: list[dict[str, Any]], uid: str, handler: str, **traced: str) -> bool:
    """Whether ``handler`` succeeded on object ``uid`` after the operator traced an event of
    it matching ``traced`` (``resourceVersion``, ``eventType``: the handlers' debug line).
    kopf handles one object's events one at a time, so the next outcome of ``handler`` on
    that object after the trace is that event's."""
    for i, record in enumerate(records):
        if _uid(record) != uid or any(record.get(k) != v for k, v in traced.items()):
            continue
        for later in records[i + 1 :]:
            if _uid(later) != uid:
                continue
            if "resourceVersion" in later:  # the next event's trace: this one had no outcome
                break
            if later.get("message", "").startswith(f"Handler '{handler}'"):
                if later["message"] == succeeded(handler):
                    return True
                break
    return False


def _require_trace(operator: OperatorProcess) -> None:
    assert operator.verbose, "the handlers' event trace is a debug line: start it verbose"


async def handled_version(
    cluster: Cluster, operator: OperatorProcess, path: str, handler: str
) -> None:
    """Evidence that ``handler`` has run on the object at ``path`` as it is now: on an event
    carrying its current resourceVersion (read afresh each time; kopf hands a handler the
    latest of the events that queued up), so on every change before it. A leftover event of
    an earlier version does not count."""
    _require_trace(operator)

    async def probe() -> bool:
        body = await cluster.client.get(path)
        assert body is not None, f"{path} is gone"
        meta = body["metadata"]
        version = str(meta["resourceVersion"])
        return ran_on(operator.current_records(), meta["uid"], handler, resourceVersion=version)

    await eventually(probe, timeout=60, what=f"{handler} on {path} as it is now")


async def handled_deletion(operator: OperatorProcess, uid: str, handler: str) -> None:
    """Evidence that ``handler`` has run on the DELETED event of the object ``uid``."""
    _require_trace(operator)

    async def probe() -> bool:
        return ran_on(operator.current_records(), uid, handler, eventType="DELETED")

    await eventually(probe, timeout=60, what=f"{handler} on the deletion of {uid}")


async def workload_events_handled(cluster: Cluster, operator: OperatorProcess, ns: str) -> None:
    """Evidence that the operator has handled every event of the workload so far: its
    current version's (``handled_version``)."""
    await handled_version(cluster, operator, deploy_path(ns), "deployment_event")


async def spec_handled(cluster: Cluster, ns: str, fields: dict[str, Any], name: str = MD) -> None:
    """Evidence that the spec handlers have run on a spec with these ``fields``: kopf records
    the spec it last handled to success on the object itself (its diff base), so an earlier
    spec's outcome does not count."""

    async def probe() -> bool:
        body = await cluster.client.get(md_path(ns, name)) or {}
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        last = json.loads(annotations.get(LAST_HANDLED, "{}")).get("spec") or {}
        return all(last.get(k) == v for k, v in fields.items())

    await eventually(probe, timeout=60, what=f"the spec handlers on {fields}")


def operator_writes(cluster: Cluster, method: str, path: str) -> int | None:
    """Requests the operator sent (kmock tier); None on the real tier (no request log)."""
    if cluster.fake is None:
        return None
    count: int = cluster.fake.writes(method, path, agent=OPERATOR_AGENT)
    return count
