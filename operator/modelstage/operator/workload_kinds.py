"""The workload kinds a ModelDeployment may target, and where each keeps its pod templates.

One row per kind: its API version and plural, the paths of its pod templates and how its pods
are selected. A Deployment or StatefulSet has one template (``spec.template``); a
LeaderWorkerSet has the leader's (``spec.leaderWorkerTemplate.leaderTemplate``, optional: the
leaders then run the worker template) and the workers'
(``spec.leaderWorkerTemplate.workerTemplate``). "The serving template" is the one whose vLLM
container serves the API (the leader's): validation, the vLLM version, the digest annotation
and the observation read it; the rollout patches every template.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelstage.api.objects import KubeObject

Path = tuple[str, ...]
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
"""Set by the LeaderWorkerSet controller on every pod of the set (leaders and workers)."""
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""A pod's index in its group: ``0`` is the group's leader."""
LEADER_TEMPLATE: Path = ("spec", "leaderWorkerTemplate", "leaderTemplate")
WORKER_TEMPLATE: Path = ("spec", "leaderWorkerTemplate", "workerTemplate")
POD_TEMPLATE: Path = ("spec", "template")


@dataclass(frozen=True)
class WorkloadKind:
    kind: str
    api_version: str
    plural: str
    templates: tuple[Path, ...]
    """Where its pod templates are, the serving one first."""
    optional: tuple[Path, ...] = ()
    """Templates it may leave out (their pods then run the next template of ``templates``)."""

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]


KINDS: dict[str, WorkloadKind] = {
    "Deployment": WorkloadKind("Deployment", "apps/v1", "deployments", (POD_TEMPLATE,)),
    "StatefulSet": WorkloadKind("StatefulSet", "apps/v1", "statefulsets", (POD_TEMPLATE,)),
    "LeaderWorkerSet": WorkloadKind(
        "LeaderWorkerSet",
        "leaderworkerset.x-k8s.io/v1",
        "leaderworkersets",
        (LEADER_TEMPLATE, WORKER_TEMPLATE),
        optional=(LEADER_TEMPLATE,),
    ),
}


def kind_of(workload: KubeObject) -> WorkloadKind:
    """The row of a workload as the API server returns it (with its ``kind``); a manifest
    without one is taken for a Deployment (one ``spec.template``)."""
    return KINDS.get(str(workload.get("kind") or "Deployment"), KINDS["Deployment"])


def get_path(obj: KubeObject, path: Path) -> KubeObject | None:
    node: KubeObject | None = obj
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node if isinstance(node, dict) else None


def template_paths(workload: KubeObject) -> tuple[Path, ...]:
    """The paths of the templates the workload has, the serving one first (an optional
    template it leaves out is not there to patch)."""
    kind = kind_of(workload)
    return tuple(
        p for p in kind.templates if p not in kind.optional or get_path(workload, p) is not None
    )


def serving_path(workload: KubeObject) -> Path:
    return template_paths(workload)[0]


def serving_template(workload: KubeObject) -> KubeObject:
    """The template of the pods that serve the API (``{}`` when it has none)."""
    return get_path(workload, serving_path(workload)) or {}


def serving_pod_spec(workload: KubeObject) -> KubeObject:
    return serving_template(workload).get("spec") or {}


def templates(workload: KubeObject) -> list[tuple[Path, KubeObject]]:
    """Every pod template with its path, the serving one first."""
    return [(p, get_path(workload, p) or {}) for p in template_paths(workload)]


def with_templates(workload: KubeObject, new: dict[Path, KubeObject]) -> KubeObject:
    """A copy of ``workload`` (copied along the paths only) with the templates at ``new``."""
    out = dict(workload)
    for path, template in new.items():
        node = out
        for key in path[:-1]:
            node[key] = dict(node.get(key) or {})
            node = node[key]
        node[path[-1]] = template
    return out


def pod_selector(workload: KubeObject) -> dict[str, str] | None:
    """The labels that select the workload's pods (a LeaderWorkerSet's controller labels all
    of its pods, leaders and workers, with the set's name)."""
    if kind_of(workload).kind == "LeaderWorkerSet":
        return {LWS_NAME_LABEL: str((workload.get("metadata") or {}).get("name") or "")}
    selector = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels")
    return dict(selector) if isinstance(selector, dict) else None


def replicas(workload: KubeObject) -> int:
    """Its replicas (a LeaderWorkerSet's: groups); 1 when unset, as each API defaults it."""
    return int((workload.get("spec") or {}).get("replicas", 1))


def pod_count(workload: KubeObject) -> int:
    """How many pods it runs: a LeaderWorkerSet's groups times their size."""
    if kind_of(workload).kind != "LeaderWorkerSet":
        return replicas(workload)
    size = get_path(workload, ("spec", "leaderWorkerTemplate")) or {}
    return replicas(workload) * int(size.get("size", 1))
