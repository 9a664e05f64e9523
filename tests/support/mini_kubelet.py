"""The Job controller and the kubelet for end-to-end live tests: every Job the operator creates
in a namespace runs here, for real, as a local process.

A Job's container command (``modelstage resolve``/``stage``/``node-copy`` ...) runs with the
checkout's ``modelstage``; each of its volume mounts is a local folder: a claim is a folder
per claim name, an ``emptyDir`` a fresh folder, the node-cache hostPath the root of the node
the Job is pinned to (its required node affinity on ``metadata.name``). Mount paths in the
arguments and environment are rewritten to those folders. When the process ends, its last
output line is the termination message and the Job is finished as the controllers would
(``finish_stage_job``), so the operator reads real summaries of real work.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelstage.core.node_cache import DEFAULT_ROOT

from support.kube_cluster import Cluster
from support.modelstage_objects import finish_stage_job, job_path

BIN = Path(sys.executable).parent


@dataclass
class MiniKubelet:
    cluster: Cluster
    namespace: str
    claims: Path
    """``<claims>/<claimName>`` is that claim's volume."""
    nodes: Mapping[str, Path]
    """Each node's cache root (the hostPath ``DEFAULT_ROOT`` on that node)."""
    scratch: Path
    ran: list[dict[str, Any]] = field(default_factory=list)
    """Each Job run: name, node, exit code, last line."""
    _seen: set[str] = field(default_factory=set)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> MiniKubelet:
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
                name = job["metadata"]["name"]
                if name not in self._seen and not (job.get("status") or {}).get("conditions"):
                    self._seen.add(name)
                    await self._run(job)
            await asyncio.sleep(0.2)

    async def _run(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        node = _pinned_node(pod)
        rc, message = await self.run_container(name, pod, container, node)
        self.ran.append({"name": name, "node": node, "rc": rc, "message": message})
        await finish_stage_job(
            self.cluster.client,
            self.namespace,
            "",
            message=message,
            succeeded=rc == 0,
            job_name=name,
            container=container["name"],
        )

    async def run_container(
        self, name: str, pod: dict[str, Any], container: dict[str, Any], node: str | None = None
    ) -> tuple[int, str]:
        """Runs one container of ``pod`` (a Job's, or an initContainer of a workload's pod
        template) as a local process; its exit code and last line. ``python3``/``python`` is
        this interpreter: a vLLM image's Python, with the checkout's modelstage and vLLM."""
        mounts = self._mounts(name, pod, container, node)
        argv = [
            _local(a, mounts) for a in [*container.get("command", []), *container.get("args", [])]
        ]
        if argv and argv[0] == "modelstage":
            argv[0] = str(BIN / "modelstage")
        elif argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = _local(str(item["value"]), mounts)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            cwd=self.scratch,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=600)
        lines = [ln for ln in (out.decode() or err.decode()).splitlines() if ln.strip()]
        if proc.returncode != 0:
            lines = [ln for ln in err.decode().splitlines() if ln.startswith("error:")] or lines
        return int(proc.returncode or 0), lines[-1] if lines else ""

    def _mounts(
        self, job: str, pod: dict[str, Any], container: dict[str, Any], node: str | None
    ) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume:
                local = self.claims / volume["persistentVolumeClaim"]["claimName"]
            elif "hostPath" in volume:
                assert volume["hostPath"]["path"] == DEFAULT_ROOT, volume
                assert node is not None, f"Job {job} mounts the node cache but is not pinned"
                local = self.nodes[node]
            elif "emptyDir" in volume:
                local = self.scratch / job / mount["name"]
            else:
                continue
            local.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = local
        return mounts


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
