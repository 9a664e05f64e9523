"""What each operator metric records (``operator/metrics.py``), without a running operator:
the state gauges fed by watch events, the counters, and the exposition on the metrics port."""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from modelstage.operator import metrics
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def samples(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """{label value: sample value} of one single-label family, from the text exposition."""
    text = generate_latest(registry).decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[next(iter(s.labels.values()), "")] = s.value
    return out


@pytest.fixture
def gauge() -> Iterator[tuple[CollectorRegistry, metrics._StateGauge]]:
    registry = CollectorRegistry()
    g = metrics._StateGauge("test_objects", "Objects by state.", "state", ("A", "B"))
    registry.register(g)
    yield registry, g


def test_a_state_gauge_counts_objects_by_their_last_state(
    gauge: tuple[CollectorRegistry, metrics._StateGauge],
) -> None:
    registry, g = gauge
    assert samples(registry, "test_objects") == {"A": 0, "B": 0}, "declared states at zero"
    g.set("ns", "x", "A")
    g.set("ns", "y", "A")
    g.set("other", "x", "B")  # same name, another namespace: another object
    assert samples(registry, "test_objects") == {"A": 2, "B": 1}
    g.set("ns", "x", "B")  # an object moves: counted once, in its new state
    assert samples(registry, "test_objects") == {"A": 1, "B": 2}


def test_a_state_gauge_forgets_deleted_objects_and_shows_undeclared_states(
    gauge: tuple[CollectorRegistry, metrics._StateGauge],
) -> None:
    registry, g = gauge
    g.set("ns", "x", "A")
    g.set("ns", "y", "Weird")
    assert samples(registry, "test_objects") == {"A": 1, "B": 0, "Weird": 1}
    g.forget("ns", "x")
    g.forget("ns", "never-seen")  # a DELETED event for an object never seen: no error
    assert samples(registry, "test_objects") == {"A": 0, "B": 0, "Weird": 1}


def test_the_operators_gauges_declare_every_job_state_and_phase() -> None:
    assert samples(metrics.REGISTRY, "modelstage_operator_stage_jobs").keys() >= {
        "Running", "Succeeded", "Failed"
    }  # fmt: skip
    assert samples(metrics.REGISTRY, "modelstage_operator_model_deployments").keys() >= {
        "Pending", "Staging", "Staged", "RollingOut", "Ready", "Failed"
    }  # fmt: skip


def test_the_counters_count_by_their_labels_under_their_exposed_names() -> None:
    reconciles = samples(metrics.REGISTRY, "modelstage_operator_reconciles_total")
    patches = samples(metrics.REGISTRY, "modelstage_operator_workload_patches_total")
    created = samples(metrics.REGISTRY, "modelstage_operator_stage_jobs_created_total")
    metrics.RECONCILES.labels("ok").inc()
    metrics.RECONCILES.labels("ok").inc()
    metrics.RECONCILES.labels("conflict").inc()
    metrics.WORKLOAD_PATCHES.labels("roll-back").inc()
    metrics.JOBS_CREATED.inc()
    after = samples(metrics.REGISTRY, "modelstage_operator_reconciles_total")
    assert after["ok"] - reconciles.get("ok", 0) == 2
    assert after["conflict"] - reconciles.get("conflict", 0) == 1
    assert (
        samples(metrics.REGISTRY, "modelstage_operator_workload_patches_total")["roll-back"]
        - patches.get("roll-back", 0)
        == 1
    )
    assert (
        samples(metrics.REGISTRY, "modelstage_operator_stage_jobs_created_total")[""]
        - created.get("", 0)
        == 1
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_serve_exposes_the_registry_on_its_port_and_port_zero_serves_nothing() -> None:
    threads = threading.active_count()
    metrics.serve(0)
    assert threading.active_count() == threads, "port 0 started a server"
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert "# TYPE modelstage_operator_reconciles_total counter" in text
    assert 'modelstage_operator_stage_jobs{state="Running"}' in text
    assert "python_gc_objects_collected_total" not in text, "only the operator's registry"
