"""Prometheus metrics of the operator (prometheus-client), served on a port of their own.

- ``modelstage_operator_reconciles_total{result}``: reconciliations by outcome (``ok``,
  ``waiting``, ``conflict``, ``failed``, ``error``).
- ``modelstage_operator_stage_jobs{state}``: stager Jobs the operator sees, by state.
- ``modelstage_operator_stage_jobs_created_total``: Jobs this process created.
- ``modelstage_operator_model_deployments{phase}``: ModelDeployments by ``status.phase``.
- ``modelstage_operator_workload_patches_total{action}``: pod-template patches sent
  (``roll-out``, ``roll-back``).
- ``modelstage_node_cache_nodes{namespace,model_deployment,state}``: per ModelDeployment with
  node caching, its nodes by copy state (``status.nodeCache.nodes``).
- ``modelstage_node_cache_pod_starts_total{result}``: serving pods whose prepare found the
  node-local copy (``hit``) or not (``miss``), each pod counted once by this process.

The two gauges are computed at scrape time from what the watch streams last delivered, so a
restarted operator reports the cluster's state, not its own history.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "modelstage_operator_reconciles",
    "ModelDeployment reconciliations by result.",
    ["result"],
    registry=REGISTRY,
)
JOBS_CREATED = Counter(
    "modelstage_operator_stage_jobs_created",
    "Stager Jobs created by this operator process.",
    registry=REGISTRY,
)
WORKLOAD_PATCHES = Counter(
    "modelstage_operator_workload_patches",
    "Pod-template patches sent to serving workloads, by action.",
    ["action"],
    registry=REGISTRY,
)
JOB_STATES = ("Running", "Succeeded", "Failed")
PHASES = ("Pending", "Staging", "Staged", "RollingOut", "Ready", "Failed")


class _StateGauge(Collector):
    """A gauge of objects by state, fed by watch events (``set``/``forget`` per object)."""

    def __init__(self, name: str, documentation: str, label: str, states: tuple[str, ...]):
        self._name, self._doc, self._label, self._states = name, documentation, label, states
        self._lock = threading.Lock()
        self._by_object: dict[tuple[str, str], str] = {}

    def set(self, namespace: str, name: str, state: str) -> None:
        with self._lock:
            self._by_object[namespace, name] = state

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._by_object.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            states = list(self._by_object.values())
        family = GaugeMetricFamily(self._name, self._doc, labels=[self._label])
        for state in sorted({*self._states, *states}):
            family.add_metric([state], states.count(state))
        yield family


JOBS = _StateGauge("modelstage_operator_stage_jobs", "Stager Jobs by state.", "state", JOB_STATES)
DEPLOYMENTS = _StateGauge(
    "modelstage_operator_model_deployments", "ModelDeployments by phase.", "phase", PHASES
)
REGISTRY.register(JOBS)
REGISTRY.register(DEPLOYMENTS)

NODE_STATES = ("Pending", "Copying", "Ready", "Warm", "Failed")
NODE_CACHE_POD_STARTS = Counter(
    "modelstage_node_cache_pod_starts",
    "Serving pods that found the artifact's node-local copy (hit) or not (miss).",
    ["result"],
    registry=REGISTRY,
)


class _NodeCacheNodes(Collector):
    """Per ModelDeployment, its nodes by copy state, as its last reconciliation saw them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_object: dict[tuple[str, str], dict[str, int]] = {}

    def set(self, namespace: str, name: str, states: Iterable[str] | None) -> None:
        """``states``: one per node; None forgets the ModelDeployment (node caching off)."""
        with self._lock:
            if states is None:
                self._by_object.pop((namespace, name), None)
                return
            counts = dict.fromkeys(NODE_STATES, 0)
            for state in states:
                counts[state] = counts.get(state, 0) + 1
            self._by_object[namespace, name] = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            items = sorted(self._by_object.items())
        family = GaugeMetricFamily(
            "modelstage_node_cache_nodes",
            "Nodes of a ModelDeployment with node caching, by the state of their copy.",
            labels=["namespace", "model_deployment", "state"],
        )
        for (namespace, name), counts in items:
            for state, count in sorted(counts.items()):
                family.add_metric([namespace, name, state], count)
        yield family


NODE_CACHE_NODES = _NodeCacheNodes()
REGISTRY.register(NODE_CACHE_NODES)


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Starts the metrics endpoint in a daemon thread (``port`` 0: no endpoint)."""
    if port:
        start_http_server(port, addr=host, registry=REGISTRY)
