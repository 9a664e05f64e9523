"""Load-phase metrics per rank: Prometheus gauges and counters, plus one JSON log line.

Every tensor-parallel rank is its own process with its own ``prometheus_client`` registry,
so each rank serves its own endpoint on ``MODELSTAGE_METRICS_PORT + rank``: no shared
multiprocess directory to configure, no dependence on whether vLLM runs its API server. The
figures describe the last load of the process (gauges) and the bytes of every load (counter);
``docs/metrics.md`` documents each metric. The log line carries the same figures for setups
that scrape nothing. ``prometheus_client`` is imported when a load publishes, never when the
plugin registers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from modelstage.core.engine_cache import RESULTS

PHASES = ("verify", "read", "host_to_device", "post_process", "total")
VERIFICATION_MODES = ("stream", "pass", "off")
STARTUP_RECORD = "startup.json"
"""Written by ``modelstage prepare`` beside the plugin it installs: prepare's phases and its
engine-cache verdict, exported by every rank with the rank's own phases."""
WEIGHT_PHASES = {"verify": "weights_verify", "read": "weights_read",
                 "host_to_device": "weights_to_device", "total": "weights_total"}  # fmt: skip
"""The load phases that are also start-up phases, under their start-up names."""
READY_URL_ENV = "MODELSTAGE_READY_URL"
LOG = logging.getLogger("vllm.modelstage")
"""Under ``vllm.`` so that vLLM's own log handler and format apply."""


@dataclass
class LoadRecord:
    """What one rank's load did; filled in by the loader, published once at the end."""

    rank: int
    tensor_parallel_size: int
    load_format: str
    artifact: str
    digest: str = ""
    artifact_format: str = ""
    layout_version: str = ""
    bytes: int = 0
    files: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    """Per phase (``PHASES``); phases overlap (read and host_to_device do)."""
    read_wait_seconds: float = 0.0
    weights_seconds: float = 0.0
    """Wall time of the weight transfer itself (reads and copies, overlapped)."""
    verification: str = ""
    """``stream``, ``pass`` or ``off`` (``base.py``)."""
    verified_bytes: int = 0
    hash_seconds: float = 0.0
    """Seconds spent hashing, summed over threads (overlapping the reads when streaming)."""
    node_cache: str = ""
    """``hit`` (read from the node-local copy), ``miss``, or "" (no node cache configured)."""

    @property
    def throughput(self) -> float:
        return self.bytes / self.weights_seconds if self.weights_seconds > 0 else 0.0

    def log_line(self) -> str:
        doc: dict[str, Any] = asdict(self)
        doc["seconds"] = {k: round(v, 6) for k, v in self.seconds.items()}
        doc["throughput_bytes_per_second"] = round(self.throughput)
        return "modelstage load " + json.dumps(doc, sort_keys=True, separators=(",", ":"))


INFO_LABELS = ("digest", "artifact_format", "layout_version", "artifact", "tensor_parallel_size")
"""What ``modelstage_artifact_info`` says of the artifact, beside the rank and load format."""


class _Metrics:
    """The process's metric objects, created on first use (one registry per process)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        labels = ("rank", "load_format")
        self.bytes = Counter(
            "modelstage_load_bytes", "Bytes of the artifact read by this rank's loads.", labels
        )
        self.files = Gauge(
            "modelstage_load_files", "Artifact files read by this rank's last load.", labels
        )
        self.phase = Gauge(
            "modelstage_load_phase_seconds",
            "Seconds of each load phase of this rank's last load; read and host_to_device "
            "overlap, total is the whole load_model call.",
            (*labels, "phase"),
        )
        self.wait = Gauge(
            "modelstage_load_read_wait_seconds",
            "Seconds the copier waited for reads in this rank's last load (read-bound if "
            "close to the read phase).",
            labels,
        )
        self.throughput = Gauge(
            "modelstage_load_throughput_bytes_per_second",
            "Bytes per second of this rank's last weight transfer (read and copy overlapped).",
            labels,
        )
        self.completed = Gauge(
            "modelstage_load_completed_timestamp_seconds",
            "Unix time at which this rank's last load finished.",
            labels,
        )
        self._add_verification(labels)
        self._add_startup(labels)

    def _add_verification(self, labels: tuple[str, ...]) -> None:
        """How the bytes were checked, and whether they came from the node cache."""
        from prometheus_client import Counter, Gauge

        self.verification = Gauge(
            "modelstage_load_verification",
            "How this rank's last load verified content (value 1 for the mode used): stream "
            "(every byte hashed as it was read), pass (hashed before loading), off "
            "(MODELSTAGE_VERIFY=0: not verified).",
            (*labels, "mode"),
        )
        self.verified = Counter(
            "modelstage_load_verified_bytes",
            "Bytes hashed against the manifest by this rank's loads.",
            labels,
        )
        self.hash_seconds = Gauge(
            "modelstage_load_hash_seconds",
            "Seconds spent hashing in this rank's last load, summed over threads (they "
            "overlap the reads when streaming).",
            labels,
        )
        self.node_cache = Counter(
            "modelstage_node_cache_load",
            "This rank's loads with a node cache configured, by result: hit (read from the "
            "node-local copy) or miss (read from the artifact).",
            (*labels, "result"),
        )

    def _add_startup(self, labels: tuple[str, ...]) -> None:
        """The pod's start as a whole: its phases, the engine cache, the artifact loaded."""
        from prometheus_client import Gauge

        self.startup = Gauge(
            "modelstage_startup_phase_seconds",
            "Seconds of each phase of this pod's start as this rank saw it: prepare's (from "
            "its startup.json), the weights', and the process's start up to loaded weights.",
            ("rank", "phase"),
        )
        self.engine_cache = Gauge(
            "modelstage_engine_cache_result",
            "prepare's engine-cache verdict for this pod (value 1 for the result): hit (placed "
            "and verified), miss (another configuration), corrupt (damaged), absent (none).",
            ("rank", "result"),
        )
        self.info = Gauge(
            "modelstage_artifact_info",
            "The artifact this rank loaded last (value 1).",
            (*labels, *INFO_LABELS),
        )


_metrics: _Metrics | None = None
_servers: dict[int, bool] = {}
_lock = threading.Lock()


def metrics() -> _Metrics:
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = _Metrics()
        return _metrics


def publish(record: LoadRecord, *, port: int | None, addr: str) -> int | None:
    """Set the metrics, log the line, and serve on ``port + rank``; returns the port served."""
    m = metrics()
    labels = {"rank": str(record.rank), "load_format": record.load_format}
    m.bytes.labels(**labels).inc(record.bytes)
    m.files.labels(**labels).set(record.files)
    for phase in PHASES:
        m.phase.labels(**labels, phase=phase).set(record.seconds.get(phase, 0.0))
    m.wait.labels(**labels).set(record.read_wait_seconds)
    for mode in VERIFICATION_MODES:
        m.verification.labels(**labels, mode=mode).set(1 if mode == record.verification else 0)
    m.verified.labels(**labels).inc(record.verified_bytes)
    m.hash_seconds.labels(**labels).set(record.hash_seconds)
    if record.node_cache:
        m.node_cache.labels(**labels, result=record.node_cache).inc()
    m.throughput.labels(**labels).set(record.throughput)
    m.completed.labels(**labels).set(time.time())
    m.info.labels(
        **labels,
        digest=record.digest,
        artifact_format=record.artifact_format,
        layout_version=record.layout_version,
        artifact=record.artifact,
        tensor_parallel_size=str(record.tensor_parallel_size),
    ).set(1)
    publish_startup(record, startup_record())
    LOG.info("%s", record.log_line())
    return serve(port + record.rank, addr) if port is not None else None


def startup_phases(record: LoadRecord, prepared: dict[str, Any]) -> dict[str, float]:
    """This rank's start-up phases: prepare's, the load's (under ``WEIGHT_PHASES`` names) and
    ``process_to_loaded``, the seconds from this process's start to the end of the load."""
    phases = {str(k): float(v) for k, v in prepared.get("phases", {}).items()}
    for load_phase, name in WEIGHT_PHASES.items():
        if load_phase in record.seconds:
            phases[name] = record.seconds[load_phase]
    since = process_age()
    if since is not None:
        phases["process_to_loaded"] = since
    return phases


def publish_startup(record: LoadRecord, prepared: dict[str, Any]) -> None:
    m = metrics()
    rank = str(record.rank)
    for phase, seconds in startup_phases(record, prepared).items():
        m.startup.labels(rank=rank, phase=phase).set(seconds)
    result = prepared.get("engineCache", "")
    if result in RESULTS:
        for name in RESULTS:
            m.engine_cache.labels(rank=rank, result=name).set(1 if name == result else 0)
    url = os.environ.get(READY_URL_ENV)
    if url and record.rank == 0:
        threading.Thread(target=watch_ready, args=(url,), daemon=True,
                         name="modelstage-ready").start()  # fmt: skip


def watch_ready(url: str, interval: float = 0.5, deadline: float = 7200.0) -> float | None:
    """Poll the pod's readiness endpoint (``MODELSTAGE_READY_URL``, e.g. vLLM's
    ``http://127.0.0.1:8000/health``) until it first answers 200, then set the ``ready`` phase:
    this process's age at that moment (``process_to_ready``). Gives up after ``deadline``."""
    import urllib.error
    import urllib.request

    waited = 0.0
    while waited < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    age = process_age()
                    if age is not None:
                        metrics().startup.labels(rank="0", phase="process_to_ready").set(age)
                    return age
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(interval)
        waited += interval
    return None


def startup_record(path: Path | None = None) -> dict[str, Any]:
    """prepare's record: ``MODELSTAGE_STARTUP_RECORD``, else ``startup.json`` in the folder
    the plugin was installed into; {} when there is none or it cannot be read."""
    if path is None:
        env = os.environ.get("MODELSTAGE_STARTUP_RECORD")
        path = Path(env) if env else Path(__file__).resolve().parents[2] / STARTUP_RECORD
    try:
        doc = json.loads(path.read_text()[:65536])
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def process_age() -> float | None:
    """Seconds since this process started (``/proc/self/stat``'s start time in clock ticks
    since boot, against ``/proc/uptime``); None where there is no /proc."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return round(max(0.0, uptime - started), 3)


def serve(port: int, addr: str) -> int | None:
    """Start this process's endpoint once; a busy port is logged, never fatal to serving."""
    with _lock:
        if port in _servers:
            return port
        from prometheus_client import start_http_server

        try:
            start_http_server(port, addr)
        except OSError as e:
            LOG.warning("modelstage: cannot serve load metrics on %s:%d: %s", addr, port, e)
            return None
        _servers[port] = True
        return port
