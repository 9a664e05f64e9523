"""A LeaderWorkerSet for the live tests: its CRD, a multi-node vLLM set, and what the
LeaderWorkerSet controller and the kubelet would report (the tests play that controller, as
they play the Deployment controller).

The CRD is written here, not applied from the kubernetes-sigs/lws release: the tests cannot
fetch it. It is a structural schema of ``leaderworkerset.x-k8s.io/v1`` with the fields the
operator reads and writes (``spec.replicas``, ``spec.leaderWorkerTemplate`` with its
``size`` and its two pod templates, kept whole with ``x-kubernetes-preserve-unknown-fields``
as the release's generated schema spells every PodTemplateSpec field out; the status
fields of ``LeaderWorkerSetStatus``), served with the status subresource as the release
serves it.
"""

from __future__ import annotations

import copy
from typing import Any

from modelstage.api.kube_client import resource_path
from modelstage.api.objects import DIGEST_ANNOTATION, OPT_IN_ANNOTATION
from modelstage.operator.workload_kinds import (
    KINDS,
    LEADER_TEMPLATE,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    WORKER_TEMPLATE,
    get_path,
)

from support.kube_cluster import KubeHTTP

LWS = "vllm-mn"
KIND = KINDS["LeaderWorkerSet"]
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
_TEMPLATE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"},
    },
}
LWS_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{KIND.plural}.{KIND.group}"},
    "spec": {
        "group": KIND.group,
        "names": {
            "kind": KIND.kind,
            "listKind": f"{KIND.kind}List",
            "plural": KIND.plural,
            "singular": KIND.kind.lower(),
            "shortNames": ["lws"],
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": KIND.api_version.split("/")[1],
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "metadata": {"type": "object"},
                            "spec": {
                                "type": "object",
                                "required": ["leaderWorkerTemplate"],
                                "properties": {
                                    "replicas": {"type": "integer", "default": 1},
                                    "startupPolicy": {"type": "string"},
                                    "leaderWorkerTemplate": {
                                        "type": "object",
                                        "required": ["workerTemplate"],
                                        "properties": {
                                            "size": {"type": "integer", "default": 1},
                                            "restartPolicy": {"type": "string"},
                                            "leaderTemplate": _TEMPLATE,
                                            "workerTemplate": _TEMPLATE,
                                        },
                                    },
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "replicas": {"type": "integer"},
                                    "readyReplicas": {"type": "integer"},
                                    "updatedReplicas": {"type": "integer"},
                                    "hpaPodSelector": {"type": "string"},
                                    "conditions": {"type": "array", "items": _CONDITION},
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


def lws_path(ns: str, name: str | None = LWS, sub: str | None = None) -> str:
    return resource_path(KIND.api_version, KIND.plural, ns, name, sub)


def _vllm(node_rank: str, *extra: str) -> dict[str, Any]:
    return {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.32.0",
        "command": ["vllm", "serve"],
        "args": [
            "acme/tiny-llama",
            "--tensor-parallel-size=2",
            "--pipeline-parallel-size=2",
            "--nnodes=2",
            f"--node-rank={node_rank}",
            "--master-addr=$(LWS_LEADER_ADDRESS)",
            *extra,
        ],
        "resources": {"limits": {"nvidia.com/gpu": "2"}},
    }


def vllm_lws(model_deployment: str, name: str = LWS) -> dict[str, Any]:
    """One group of two pods: the leader serves the API, the worker runs vLLM headless
    (vLLM's multi-node recipe, TP 2 within a node and PP 2 across the two)."""
    return {
        "apiVersion": KIND.api_version,
        "kind": KIND.kind,
        "metadata": {"name": name, "annotations": {OPT_IN_ANNOTATION: model_deployment}},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": 2,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": {"role": "leader"}},
                    "spec": {"containers": [_vllm("0")]},
                },
                "workerTemplate": {
                    "spec": {"containers": [_vllm("$(LWS_WORKER_INDEX)", "--headless")]}
                },
            },
        },
    }


def template_digests(lws: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """The digest annotation of the leader and the worker templates."""
    if lws is None:
        return None, None
    found = []
    for path in (LEADER_TEMPLATE, WORKER_TEMPLATE):
        template = get_path(lws, path) or {}
        found.append(
            ((template.get("metadata") or {}).get("annotations") or {}).get(DIGEST_ANNOTATION)
        )
    return found[0], found[1]


def _pod(lws: dict[str, Any], path: tuple[str, ...], worker: int) -> dict[str, Any]:
    """A pod of group 0 as the LeaderWorkerSet controller makes it from a template."""
    name = lws["metadata"]["name"]
    template = copy.deepcopy(get_path(lws, path) or {})
    meta = template.get("metadata") or {}
    labels = {**(meta.get("labels") or {}), LWS_NAME_LABEL: name,
              LWS_WORKER_INDEX_LABEL: str(worker), GROUP_INDEX_LABEL: "0"}  # fmt: skip
    digest = ((meta.get("annotations") or {}).get(DIGEST_ANNOTATION) or "none")[:12]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-0-{digest}" + (f"-{worker}" if worker else ""),
            "labels": labels,
            "annotations": meta.get("annotations") or {},
        },
        "spec": template["spec"],
    }


READY = {"type": "Ready", "status": "True", "lastTransitionTime": "2030-01-01T00:01:00Z"}


async def play_lws_controller(client: KubeHTTP, ns: str, name: str = LWS) -> None:
    """What the LeaderWorkerSet controller and the kubelets report as group 0 moves onto the
    current templates: the set's rolling update under way, the group's leader and worker pods
    made from the templates and Ready, then the set's status once all groups are updated and
    ready (``Available``)."""
    lws = await client.get(lws_path(ns, name))
    assert lws is not None
    replicas = lws["spec"].get("replicas", 1)
    await _set_status(client, ns, name, replicas, 0, "UpdateInProgress", "GroupsUpdating")
    size = lws["spec"]["leaderWorkerTemplate"].get("size", 1)
    for worker in range(size):
        path = LEADER_TEMPLATE if worker == 0 else WORKER_TEMPLATE
        pod = _pod(lws, path, worker)
        await client.create(resource_path("v1", "pods", ns), pod)
        await client.patch(
            resource_path("v1", "pods", ns, pod["metadata"]["name"], "status"),
            {"status": {"phase": "Running", "conditions": [READY]}},
        )
    await _set_status(client, ns, name, replicas, replicas, "Available", "AllGroupsReady")


async def _set_status(
    client: KubeHTTP, ns: str, name: str, replicas: int, done: int, type_: str, reason: str
) -> None:
    condition = {"type": type_, "status": "True", "reason": reason, "message": reason,
                 "lastTransitionTime": "2030-01-01T00:01:00Z"}  # fmt: skip
    status = {"replicas": replicas, "readyReplicas": done, "updatedReplicas": done,
              "conditions": [condition]}  # fmt: skip
    await client.patch(lws_path(ns, name, "status"), {"status": status})


async def crash_looping_leader(client: KubeHTTP, ns: str, name: str = LWS) -> None:
    """The leader of group 0 on the current templates, its vLLM container in a crash loop."""
    lws = await client.get(lws_path(ns, name))
    assert lws is not None
    pod = _pod(lws, LEADER_TEMPLATE, 0)
    await client.create(resource_path("v1", "pods", ns), pod)
    await client.patch(
        resource_path("v1", "pods", ns, pod["metadata"]["name"], "status"),
        {
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "vllm", "ready": False, "restartCount": 4, "image": "x",
                        "imageID": "",
                        "state": {"waiting": {"reason": "CrashLoopBackOff",
                                              "message": "back-off 40s restarting"}},
                        "lastState": {"terminated": {
                            "exitCode": 1, "reason": "Error",
                            "message": "RuntimeError: pipeline stage 1 unreachable",
                            "startedAt": "2030-01-01T00:00:00Z",
                            "finishedAt": "2030-01-01T00:00:05Z"}},
                    }
                ],
            }
        },
    )  # fmt: skip
