"""The Job controller and the kubelet for end-to-end live tests (real tier): every Job the
operator creates in a namespace runs here, for real, as a local process, and serving pods of
the workload start on a node as far as their ``modelstage-prepare`` initContainer.

Each Job's pod is created on the API server first, from the Job's template (pinned to its node
when the template says so), so that the namespace's Pod Security admission judges exactly what
the operator asked for (the tests run the tenant namespace under ``restricted``); a refused pod
fails the test. A container command (``modelstage resolve``/``stage``/``node-copy`` ...) runs
with the checkout's ``modelstage``, ``$(VAR)`` references expanded from its environment; each
volume mount is a local folder: a claim a folder per claim name, an ``emptyDir`` a fresh
folder, a projected ServiceAccount token a file holding a real token (a TokenRequest for the
pod's ServiceAccount with the volume's audience, bound to the pod, so it names the pod's node).
A ``hostPath`` in a tenant's pod is refused outright. A node-cache claim of a serving pod is
followed as the kubelet would: claim -> its bound PersistentVolume -> that PV's ``local.path``
on the pod's node (the node's root folder), and the PV's node affinity must admit the node.
When a process ends, its last output line is the termination message and the pod and Job are
finished as the controllers would, so the operator reads real summaries of real work.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelstage.api.kube_client import resource_path
from modelstage.core.node_cache import DEFAULT_ROOT

from support.kube_cluster import Cluster, service_account_token
from support.modelstage_objects import job_path, pod_path

BIN = Path(sys.executable).parent
VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
T_END = "2030-01-01T00:00:10Z"
BACKOFF_S = 1.0
"""The first back-off before a failed Job pod's successor (doubling, as the controller's)."""


class PodRefused(AssertionError):
    """The API server (Pod Security admission) or this kubelet refused a pod."""


@dataclass
class MiniKubelet:
    cluster: Cluster
    namespace: str
    claims: Path
    """``<claims>/<claimName>`` is that claim's volume."""
    nodes: Mapping[str, Path]
    """Each node's cache root (``DEFAULT_ROOT`` on that node; only its agent writes there)."""
    scratch: Path
    ran: list[dict[str, Any]] = field(default_factory=list)
    """Each pod a Job ran: name, node, exit code, last line, attempt (0 for the first)."""
    refused: list[str] = field(default_factory=list)
    """Why a pod could not be created or run (a test asserts this stays empty)."""
    _seen: set[str] = field(default_factory=set)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> MiniKubelet:
        accounts = resource_path("v1", "serviceaccounts", self.namespace)
        if await self.cluster.client.get(f"{accounts}/default") is None:
            # The ServiceAccount controller's part: the namespace's default account.
            await self.cluster.client.create(accounts, {"apiVersion": "v1",
                "kind": "ServiceAccount", "metadata": {"name": "default"}})  # fmt: skip
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            for job in await self.cluster.client.list(job_path(self.namespace)):
                name, uid = job["metadata"]["name"], job["metadata"]["uid"]
                if uid not in self._seen and not (job.get("status") or {}).get("conditions"):
                    self._seen.add(uid)  # a Job replaced under its name is a new one
                    try:
                        await self._run(job)
                    except PodRefused as error:
                        self.refused.append(f"Job {name}: {error}")
                        await self.cluster.client.patch(
                            job_path(self.namespace, name, "status"),
                            {"status": _job_status(False)},
                        )
            await asyncio.sleep(0.2)

    async def _create_pod(
        self, name: str, template: dict[str, Any], node: str | None, owner: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The pod, created as the controller would; Pod Security admission judges it."""
        spec = dict(template["spec"])
        if node is not None:
            spec["nodeName"] = node
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": (template.get("metadata") or {}).get("labels")
                         or {}, "annotations": (template.get("metadata") or {}).get(
                             "annotations") or {}},
            "spec": spec,
        }  # fmt: skip
        if owner is not None:
            pod["metadata"]["ownerReferences"] = [owner]
        try:
            created: dict[str, Any] = await self.cluster.client.create(
                pod_path(self.namespace), pod
            )
        except Exception as error:
            raise PodRefused(f"pod {name} refused by the API server: {error}") from None
        return created

    async def _run(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        template = job["spec"]["template"]
        template = {**template, "metadata": {**template.get("metadata", {}), "labels": {
            **(template.get("metadata") or {}).get("labels", {}), "job-name": name,
            "batch.kubernetes.io/job-name": name}}}  # fmt: skip
        node = _pinned_node(template["spec"])
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name,
                 "uid": job["metadata"]["uid"], "controller": True}  # fmt: skip
        # The Job controller's part: a failed pod is followed by a new one, up to the Job's
        # backoffLimit (after a back-off, shorter here than the controller's 10 s doubling);
        # each pod has a name of its own (the controller's generateName), so a Job replaced
        # under its name runs while the old one's pods may still wait for the collector.
        retries = int(job["spec"].get("backoffLimit", 6))
        for attempt in range(retries + 1):
            pod_name = f"{name[:48]}-{job['metadata']['uid'][:5]}-{attempt}"
            pod = await self._create_pod(pod_name, template, node, owner)
            container = template["spec"]["containers"][0]
            mounts = await self._mounts(name, pod, container, node)
            rc, message = await self._exec(container, mounts)
            self.ran.append({"name": name, "node": node, "rc": rc, "message": message,
                             "attempt": attempt})  # fmt: skip
            await self._terminated(pod, container["name"], rc, message, init=False)
            if rc == 0 or attempt == retries:
                break
            await asyncio.sleep(BACKOFF_S * 2**attempt)
        await self.cluster.client.patch(
            job_path(self.namespace, name, "status"), {"status": _job_status(rc == 0)}
        )

    async def _exec(self, container: dict[str, Any], mounts: Mapping[str, Path]) -> tuple[int, str]:
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        values: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                values[item["name"]] = _local(str(item["value"]), mounts)
        env.update(values)
        argv = [
            _local(VARIABLE.sub(lambda m: values.get(m.group(1), m.group(0)), a), mounts)
            for a in [*container.get("command", []), *container.get("args", [])]
        ]
        if argv and argv[0] == "modelstage":
            argv[0] = str(BIN / "modelstage")
        elif argv and argv[0] in ("python", "python3"):  # a vLLM image's Python: this one
            argv[0] = sys.executable
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=self.scratch,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), timeout=600)
        lines = [ln for ln in (out.decode() or err.decode()).splitlines() if ln.strip()]
        if proc.returncode != 0:
            lines = [ln for ln in err.decode().splitlines() if ln.startswith("error:")] or lines
        return int(proc.returncode or 0), (lines[-1] if lines else "")

    async def _terminated(
        self, pod: dict[str, Any], container: str, rc: int, message: str, *, init: bool
    ) -> None:
        terminated = {"exitCode": rc, "reason": "Completed" if rc == 0 else "Error",
                      "message": message, "startedAt": "2030-01-01T00:00:01Z",
                      "finishedAt": T_END}  # fmt: skip
        state = {"name": container, "ready": False, "restartCount": 0, "image": "x",
                 "imageID": "", "state": {"terminated": terminated}}  # fmt: skip
        key = "initContainerStatuses" if init else "containerStatuses"
        phase = "Pending" if init and rc == 0 else ("Succeeded" if rc == 0 else "Failed")
        await self.cluster.client.patch(
            pod_path(self.namespace, pod["metadata"]["name"], "status"),
            {"status": {"phase": phase, key: [state]}},
        )

    async def _mounts(
        self, job: str, pod: dict[str, Any], container: dict[str, Any], node: str | None
    ) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            local = self.scratch / job / mount["name"]
            if "hostPath" in volume:
                raise PodRefused(f"{job} mounts the host path {volume['hostPath']['path']}")
            if "persistentVolumeClaim" in volume:
                local = await self._claim(volume["persistentVolumeClaim"]["claimName"], node)
            elif "projected" in volume:
                await self._project(pod, volume, local)
            elif "emptyDir" not in volume:
                continue
            local.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = local
        return mounts

    async def _project(self, pod: dict[str, Any], volume: dict[str, Any], local: Path) -> None:
        """The projected ServiceAccount tokens of ``volume``: real ones, bound to the pod."""
        local.mkdir(parents=True, exist_ok=True)
        account = pod["spec"].get("serviceAccountName") or "default"
        for source in volume["projected"].get("sources") or []:
            token = source.get("serviceAccountToken")
            if token is None:
                continue
            value = await service_account_token(
                self.cluster.client, self.namespace, account,
                bound_pod=(pod["metadata"]["name"], pod["metadata"]["uid"]),
                audience=token.get("audience"),
            )  # fmt: skip
            (local / token["path"]).write_text(value)

    async def _claim(self, claim: str, node: str | None) -> Path:
        """A claim's folder; a claim bound to a node-cache PV: that PV's copy on ``node``."""
        body = await self.cluster.client.get(
            resource_path("v1", "persistentvolumeclaims", self.namespace, claim)
        )
        volume_name = ((body or {}).get("spec") or {}).get("volumeName")
        if not volume_name:
            return self.claims / claim
        pv = await self.cluster.client.get(resource_path("v1", "persistentvolumes", None,
                                                         volume_name))  # fmt: skip
        if pv is None or "local" not in pv["spec"]:
            return self.claims / claim
        if (body or {}).get("status", {}).get("phase") != "Bound":
            raise PodRefused(f"claim {claim} is not bound to PersistentVolume {volume_name}")
        ref = pv["spec"].get("claimRef") or {}
        if (ref.get("namespace"), ref.get("name")) != (self.namespace, claim):
            raise PodRefused(f"PersistentVolume {volume_name} is bound to another claim: {ref}")
        if node is None or not await self._admits(pv, node):
            raise PodRefused(f"PersistentVolume {volume_name}'s node affinity excludes {node}")
        path = Path(pv["spec"]["local"]["path"])
        return self.nodes[node] / path.relative_to(DEFAULT_ROOT)

    async def _admits(self, pv: dict[str, Any], node: str) -> bool:
        """The scheduler's check of a PV's required node affinity (``In`` on labels)."""
        body = await self.cluster.client.get(resource_path("v1", "nodes", None, node)) or {}
        labels = body.get("metadata", {}).get("labels") or {}
        terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
        return any(
            all(labels.get(e["key"]) in e["values"] for e in t.get("matchExpressions") or [])
            for t in terms
        )

    async def start_serving_pod(
        self, template: dict[str, Any], node: str | None, name: str
    ) -> str:
        """A serving pod of ``template`` on ``node``, as far as its ``modelstage-prepare``
        initContainer: created on the API server (Pod Security), its volumes resolved, prepare
        run, its summary the initContainer's termination message. Returns that summary."""
        pod = await self._create_pod(name, template, node, None)
        (prepare,) = [c for c in pod["spec"].get("initContainers") or []
                      if c["name"] == "modelstage-prepare"]  # fmt: skip
        mounts = await self._mounts(name, pod, prepare, node)
        rc, message = await self._exec(prepare, mounts)
        await self._terminated(pod, prepare["name"], rc, message, init=True)
        return message


def _job_status(succeeded: bool) -> dict[str, Any]:
    """A finished Job's status as the Job controller writes it."""
    times = {"lastTransitionTime": T_END, "lastProbeTime": T_END}
    if succeeded:
        return {"startTime": "2030-01-01T00:00:00Z", "completionTime": T_END, "succeeded": 1,
                "active": 0, "conditions": [
                    {"type": "SuccessCriteriaMet", "status": "True", **times},
                    {"type": "Complete", "status": "True", **times}]}  # fmt: skip
    why = {"reason": "BackoffLimitExceeded", "message": "Job has reached the backoff limit"}
    return {"startTime": "2030-01-01T00:00:00Z", "failed": 1, "active": 0, "conditions": [
        {"type": "FailureTarget", "status": "True", **why, **times},
        {"type": "Failed", "status": "True", **why, **times}]}  # fmt: skip


def _pinned_node(pod: dict[str, Any]) -> str | None:
    """The node a copy Job is pinned to: required node affinity on ``metadata.name``."""
    if pod.get("nodeName"):
        return str(pod["nodeName"])
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for field_ in term.get("matchFields") or []:
            if field_.get("key") == "metadata.name" and field_.get("operator") == "In":
                return str(field_["values"][0])
    return None


def _local(value: str, mounts: Mapping[str, Path]) -> str:
    """``value`` with a mount path (at a word's start or after ``=``) made the local folder."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        for lead in ("", "="):
            marker = lead + mount_path
            index = value.find(marker)
            if index == 0 or (lead and index > 0):
                start = index + len(lead)
                rest = value[start + len(mount_path) :]
                if not rest or rest.startswith("/"):
                    return value[:start] + str(mounts[mount_path]) + rest
    return value
