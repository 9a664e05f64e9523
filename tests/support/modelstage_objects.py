"""Manifests and status patches the live operator tests use: a ModelDeployment, its vLLM
Deployment, and what the Job and Deployment controllers and the kubelet would report (the
tests play those controllers on both tiers)."""

from __future__ import annotations

import copy
import json
from typing import Any

from modelstage.api.kube_client import resource_path
from modelstage.api.modeldeployment import ModelDeploymentSpec
from modelstage.api.objects import DIGEST_ANNOTATION, OPT_IN_ANNOTATION
from modelstage.operator.artifact import spec_digest
from modelstage.operator.job_plan import stage_job_name
from modelstage.operator.resolve_plan import pinned_identity

from support.kube_cluster import KubeHTTP

WORKLOAD = "vllm"
COMMIT = "5d0f7a4e9c1b2a3948576f6e5d4c3b2a19080706"
SPEC: dict[str, Any] = {
    # A pinned commit: its identity is known from the spec, no resolve Job runs (the resolve
    # tests use a branch and play the resolve Job).
    "model": {"uri": "hf://acme/tiny-llama", "revision": COMMIT},
    "parallelism": {"tensor": 1},
    "loadFormat": "sharded_state",
    "storage": {"pvc": {"claimName": "models", "path": "/artifacts"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": WORKLOAD}, "containerName": "vllm"},
}


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def digest_of(spec: dict[str, Any], identity: str | None = None) -> str:
    """The digest the operator computes; ``identity``: the resolved one, for a spec that does
    not pin a commit."""
    parsed = ModelDeploymentSpec.model_validate(spec)
    identity = identity or pinned_identity(parsed)
    assert identity is not None, "a branch is resolved first: pass the identity"
    return spec_digest(parsed, identity)


def md_path(ns: str, name: str | None = None, sub: str | None = None) -> str:
    return resource_path("modelstage.io/v1alpha1", "modeldeployments", ns, name, sub)


def job_path(ns: str, name: str | None = None, sub: str | None = None) -> str:
    return resource_path("batch/v1", "jobs", ns, name, sub)


def deploy_path(ns: str, name: str | None = WORKLOAD, sub: str | None = None) -> str:
    return resource_path("apps/v1", "deployments", ns, name, sub)


def pod_path(ns: str, name: str | None = None, sub: str | None = None) -> str:
    return resource_path("v1", "pods", ns, name, sub)


def model_deployment(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "modelstage.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def vllm_deployment(
    name: str = WORKLOAD, replicas: int = 1, *, model_deployment: str | None = "llama"
) -> dict[str, Any]:
    """A vLLM Deployment that opts in to being patched by ModelDeployment
    ``model_deployment`` (None: no opt-in)."""
    labels = {"app": name}
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if model_deployment is not None:
        metadata["annotations"] = {OPT_IN_ANNOTATION: model_deployment}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.32.0",
                            "command": ["vllm", "serve"],
                            "args": ["acme/tiny-llama", "--max-model-len", "2048"],
                        }
                    ]
                },
            },
        },
    }


def summary(digest: str, source: str = "sha:0123abcd", nbytes: int = 123456) -> str:
    """The stager's one-line JSON summary, as its termination message holds it."""
    return json.dumps(
        {"digest": digest, "source": source, "bytes": nbytes, "files": 4, "seconds": 3.5}
    )


async def finish_stage_job(
    client: KubeHTTP,
    ns: str,
    digest: str,
    *,
    message: str,
    succeeded: bool,
    pod_name: str | None = None,
    job_name: str | None = None,
    container: str = "stager",
) -> None:
    """What the Job controller and the kubelet report when the stager pod ends: a terminated
    pod with the termination message, then the Job's conditions. ``job_name``: another of the
    artifact's Jobs than the stage Job (the scale-out finalize Job, a resolve Job, whose
    ``container`` is ``resolve``)."""
    name = job_name or stage_job_name(digest)
    job = await client.get(job_path(ns, name))
    assert job is not None, f"Job {name} does not exist"
    labels = {
        **job["spec"]["template"]["metadata"]["labels"],
        "job-name": name,
        "batch.kubernetes.io/job-name": name,
    }
    pod_name = pod_name or f"{name[:50]}-x{'ok' if succeeded else 'ko'}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": name,
                    "uid": job["metadata"]["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": container, "image": "registry.test/modelstage/stager:test"}],
        },
    }
    await client.create(pod_path(ns), pod)
    now = "2030-01-01T00:00:10Z"
    terminated = {
        "exitCode": 0 if succeeded else 1,
        "reason": "Completed" if succeeded else "Error",
        "message": message,
        "startedAt": "2030-01-01T00:00:01Z",
        "finishedAt": now,
    }
    await client.patch(
        pod_path(ns, pod_name, "status"),
        {
            "status": {
                "phase": "Succeeded" if succeeded else "Failed",
                "containerStatuses": [
                    {
                        "name": container,
                        "ready": False,
                        "restartCount": 0,
                        "image": "x",
                        "imageID": "",
                        "state": {"terminated": terminated},
                    }
                ],
            }
        },
    )
    start = "2030-01-01T00:00:00Z"
    if succeeded:
        status = {
            "startTime": start,
            "completionTime": now,
            "succeeded": 1,
            "active": 0,
            "conditions": [
                {
                    "type": "SuccessCriteriaMet",
                    "status": "True",
                    "lastTransitionTime": now,
                    "lastProbeTime": now,
                },
                {
                    "type": "Complete",
                    "status": "True",
                    "lastTransitionTime": now,
                    "lastProbeTime": now,
                },
            ],
        }
    else:
        status = {
            "startTime": start,
            "failed": 1,
            "active": 0,
            "conditions": [
                {
                    "type": "FailureTarget",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                    "lastTransitionTime": now,
                    "lastProbeTime": now,
                },
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                    "lastTransitionTime": now,
                    "lastProbeTime": now,
                },
            ],
        }
    await client.patch(job_path(ns, name, "status"), {"status": status})


async def complete_rollout(client: KubeHTTP, ns: str, name: str = WORKLOAD) -> None:
    """What the Deployment controller reports once every replica runs the new template."""
    deployment = await client.get(deploy_path(ns, name))
    assert deployment is not None
    replicas = deployment["spec"].get("replicas", 1)
    await client.patch(
        deploy_path(ns, name, "status"),
        {
            "status": {
                "observedGeneration": deployment["metadata"]["generation"],
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": replicas,
                "availableReplicas": replicas,
            }
        },
    )


async def crash_looping_pod(
    client: KubeHTTP, ns: str, digest: str, name: str = "vllm-new-1"
) -> None:
    """A pod of the workload's new template whose container restarts and fails again."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"app": WORKLOAD},
            "annotations": {DIGEST_ANNOTATION: digest},
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]},
    }
    await client.create(pod_path(ns), pod)
    await client.patch(
        pod_path(ns, name, "status"),
        {
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "vllm",
                        "ready": False,
                        "restartCount": 4,
                        "image": "x",
                        "imageID": "",
                        "state": {
                            "waiting": {
                                "reason": "CrashLoopBackOff",
                                "message": "back-off 40s restarting failed container",
                            }
                        },
                        "lastState": {
                            "terminated": {
                                "exitCode": 1,
                                "reason": "Error",
                                "message": "RuntimeError: CUDA out of memory",
                                "startedAt": "2030-01-01T00:00:00Z",
                                "finishedAt": "2030-01-01T00:00:05Z",
                            }
                        },
                    }
                ],
            }
        },
    )


def template_digest(deployment: dict[str, Any] | None) -> str | None:
    if deployment is None:
        return None
    annotations = deployment["spec"]["template"].get("metadata", {}).get("annotations") or {}
    digest: str | None = annotations.get(DIGEST_ANNOTATION)
    return digest
