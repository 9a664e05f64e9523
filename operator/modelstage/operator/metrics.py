"""Prometheus metrics of the operator (prometheus-client), served on a port of their own.

- ``modelstage_operator_reconciles_total{result}``: reconciliations by outcome (``ok``,
  ``waiting``, ``conflict``, ``failed``, ``error``).
- ``modelstage_operator_stage_jobs{state}``: stager Jobs the operator sees, by state.
- ``modelstage_operator_stage_jobs_created_total``: Jobs this process created.
- ``modelstage_operator_model_deployments{phase}``: ModelDeployments by ``status.phase``.
- ``modelstage_operator_workload_patches_total{action}``: pod-template patches sent
  (``roll-out``, ``roll-back``).

The two gauges are computed at scrape time from what the watch streams last delivered, so a
restarted operator reports the cluster's state, not its own history.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

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


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Starts the metrics endpoint in a daemon thread (``port`` 0: no endpoint)."""
    if port:
        start_http_server(port, addr=host, registry=REGISTRY)
