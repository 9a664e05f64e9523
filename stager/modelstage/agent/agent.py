"""``modelstage agent``: the node cache's DaemonSet process, one per node.

Each pass: scan the root (complete copies, partial ones; a broken copy is removed), list the
ModelDeployments of the cluster for what they pin and what they ask to be warmed, evict least
recently used unpinned copies while over the budget (``eviction.py`` decides), record the use
of pinned copies, start warming what is asked for (a thread of its own), label this node with
the digests it holds (only its own node, only labels under ``core.node_cache.LABEL_PREFIX``),
and write the node's ``NodeCache`` status (the report, with a heartbeat) and its metrics. A
pass that cannot list the ModelDeployments pins what the last successful list pinned; until
one list succeeded, nothing is evicted (what is in use is unknown). SIGTERM (or SIGINT) ends
the loop between passes, or a warm-up between blocks.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from modelstage.core import node_cache
from modelstage.core.errors import ModelstageError, SpecError
from modelstage.operator.kube_client import KubeClient, resource_path
from modelstage.operator.node_cache_api import (
    HeldArtifact,
    NodeCacheObject,
    NodeCacheReport,
    PartialCopy,
)

from . import eviction, store

log = logging.getLogger("modelstage.agent")
MD_PATH = resource_path(node_cache.API_VERSION, "modeldeployments")
NODE_CACHES = resource_path(node_cache.API_VERSION, node_cache.PLURAL)


@dataclass(frozen=True)
class AgentSettings:
    node: str
    root: Path
    budget: int
    interval: float = 10.0
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"
    kubeconfig: str | None = None


def label_patch(current: Mapping[str, str], held: Iterable[str]) -> dict[str, str | None]:
    """The merge patch of a node's labels that makes its cache labels say exactly ``held``:
    only keys under the cache prefix, ever (a user's or another tool's labels are not ours)."""
    want = {node_cache.node_label(d) for d in held}
    have = {k for k, v in current.items() if k.startswith(node_cache.LABEL_PREFIX)}
    patch: dict[str, str | None] = {k: "true" for k in sorted(want) if current.get(k) != "true"}
    patch |= {k: None for k in sorted(have - want)}
    assert all(k.startswith(node_cache.LABEL_PREFIX) for k in patch)
    return patch


def _when(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def copy_rate(copies: Iterable[store.Copy]) -> float | None:
    """The most recent copy's bytes per second (its record), None when none recorded one."""
    timed = [
        (_when(c.record.get("copiedAt")), c.bytes / s)
        for c in copies
        if (s := _number(c.record.get("copySeconds"))) and _when(c.record.get("copiedAt"))
    ]
    return max(timed, key=lambda t: t[0] or datetime.min.replace(tzinfo=UTC))[1] if timed else None


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Agent:
    settings: AgentSettings
    kube: KubeClient
    stop: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)
    """Set by a change of what ModelDeployments pin or ask to warm (the watch), by a finished
    warm-up or by ``stop``: the next pass soon (``MIN_PASS_GAP``)."""
    pinned: frozenset[str] | None = None
    """What the last successful list of ModelDeployments pinned (None: none succeeded yet)."""
    warmed: dict[str, datetime] = field(default_factory=dict)
    warm_failed: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Warm-ups that failed: when (monotonic) and why; retried once an interval."""
    warming: str | None = None
    """The digest the warm-up thread reads now."""
    evictions: int = 0
    metrics: Any = None
    clock: Callable[[], datetime] = utc_now
    _warm_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _warmer: threading.Thread | None = field(default=None, repr=False)

    @property
    def root(self) -> Path:
        return self.settings.root

    def run_pass(self) -> NodeCacheReport:
        now = self.clock()
        messages: list[str] = []
        bodies = self._model_deployments(messages)
        if bodies is not None:
            self.pinned = eviction.pinned_digests(bodies)
        try:
            scan = store.scan(self.root)
        except OSError as e:  # the report says so; the next pass tries again
            messages.append(f"cannot read the root {self.root}: {e.strerror or e}")
            return self._write_status(self._report(store.Scan(), now, messages))
        messages += [f"removed a broken copy {r}" for r in scan.removed]
        scan = self._keep_within_budget(scan, now, messages)
        held = {c.digest for c in scan.copies}
        if bodies is not None:
            # Warm while asked: a request that ended (the roll went on) forgets it, so a later
            # request (a roll back weeks later) reads the copy again.
            wanted = eviction.warm_requests(bodies, self.settings.node) & held
            self._warm(wanted, messages)
        with self._warm_lock:
            self.warmed = {d: t for d, t in self.warmed.items() if d in held}
        self._label(held, messages)
        report = self._write_status(self._report(scan, now, messages))
        if self.metrics is not None:
            self.metrics.observe(report)
        return report

    def _keep_within_budget(
        self, scan: store.Scan, now: datetime, messages: list[str]
    ) -> store.Scan:
        """Evicts what the planner says, then records the use of pinned copies (in that
        order: on a full disk the record cannot be written, and eviction is what frees the
        disk; a pinned copy is never evicted, so its old ``lastUsed`` does not matter here);
        the root's scan after that."""
        if self.pinned is None:
            messages.append("not evicting: what ModelDeployments use is not known yet")
            return scan
        pins = self.pinned
        plan = eviction.plan_eviction(
            [eviction.HeldCopy(c.digest, c.bytes, _when(c.record.get("lastUsed")),
                               c.digest in pins) for c in scan.copies],
            [eviction.PartialCopy(p.digest, p.bytes, p.locked, p.digest in pins)
             for p in scan.partials],
            self.settings.budget,
        )  # fmt: skip
        self._evict(plan, messages)
        if plan.message:
            messages.append(plan.message)
        if plan.evict or plan.drop_partials:
            scan = store.scan(self.root)
        copies = []
        for c in scan.copies:
            if c.digest in pins:
                c, why = store.touch(self.root, c, now)
                if why:
                    messages.append(why)
                    log.warning("%s", why)
            copies.append(c)
        scan.copies = copies
        return scan

    def _model_deployments(self, messages: list[str]) -> list[dict[str, Any]] | None:
        try:
            return self.kube.list(MD_PATH)
        except Exception as e:
            messages.append(f"cannot list ModelDeployments: {e}")
            log.warning("cannot list ModelDeployments: %s", e)
            return None

    def _evict(self, plan: eviction.EvictionPlan, messages: list[str]) -> None:
        for digest in plan.evict:
            if store.remove_copy(self.root, digest):
                self.evictions += 1
                if self.metrics is not None:
                    self.metrics.evicted()
                log.info("evicted %s (least recently used, over budget)", digest)
            else:
                messages.append(f"{digest}: not evicted, a copier holds its lock")
        for digest in plan.drop_partials:
            if store.remove_partial(self.root, digest):
                log.info("removed the abandoned partial copy of %s", digest)

    def _warm(self, wanted: frozenset[str], messages: list[str]) -> None:
        """Forgets what is no longer asked for (a request that ended, the roll went on: a
        later one reads the copy again) and starts the next warm-up asked for in a thread of
        its own: reading a large artifact takes minutes, and the pass goes on meanwhile (its
        report says what is warming; the finished warm-up wakes the loop). One at a time."""
        with self._warm_lock:
            self.warmed = {d: t for d, t in self.warmed.items() if d in wanted}
            self.warm_failed = {d: f for d, f in self.warm_failed.items() if d in wanted}
            failed = sorted(self.warm_failed.items())
            messages += [f"{digest}: cannot warm: {why}" for digest, (_, why) in failed]
            if self.warming is None and not self.stop.is_set():
                retry = time.monotonic() - self.settings.interval
                todo = [d for d in sorted(wanted - set(self.warmed))
                        if self.warm_failed.get(d, (retry, ""))[0] <= retry]  # fmt: skip
                if todo:
                    self.warming = todo[0]
                    self._warmer = threading.Thread(
                        target=self._warm_one, args=(todo[0],), name="modelstage-warm", daemon=True
                    )
                    self._warmer.start()
            if self.warming is not None:
                messages.append(f"warming {self.warming}")

    def _warm_one(self, digest: str) -> None:
        """The warm-up thread: one copy read into the page cache, or why it could not be."""
        try:
            seconds = store.warm(self.root, digest, self.stop)
        except (OSError, ModelstageError) as e:
            why = str(e.strerror or e) if isinstance(e, OSError) else str(e)
            log.warning("cannot warm %s: %s", digest, why)
            with self._warm_lock:
                self.warm_failed[digest] = (time.monotonic(), why)
        else:
            if not self.stop.is_set():
                with self._warm_lock:
                    self.warmed[digest] = self.clock()
                    self.warm_failed.pop(digest, None)
                if self.metrics is not None:
                    self.metrics.warmed(seconds)
                log.info("warmed %s in %.1f s", digest, seconds)
        finally:
            with self._warm_lock:
                self.warming = None
            self.wake.set()

    def join_warm(self) -> None:
        """Wait for the warm-up in progress (if any) to end."""
        warmer = self._warmer
        if warmer is not None:
            warmer.join()

    def _label(self, held: set[str], messages: list[str]) -> None:
        path = resource_path("v1", "nodes", name=self.settings.node)
        try:
            current = self.kube.get(path)
            if current is None:
                messages.append(f"node {self.settings.node} not found: not labelled")
                return
            labels = (current.get("metadata") or {}).get("labels") or {}
            patch = label_patch(labels, held)
            if patch:
                self.kube.merge_patch(path, {"metadata": {"labels": patch}})
        except Exception as e:
            messages.append(f"cannot label node {self.settings.node}: {e}")
            log.warning("cannot label node %s: %s", self.settings.node, e)

    def _report(self, scan: store.Scan, now: datetime, messages: list[str]) -> NodeCacheReport:
        with self._warm_lock:
            warmed = dict(self.warmed)
        artifacts = [
            HeldArtifact(
                digest=c.digest,
                bytes=c.bytes,
                files=c.files,
                copied_at=_when(c.record.get("copiedAt")),
                copy_seconds=_number(c.record.get("copySeconds")),
                last_used=_when(c.record.get("lastUsed")),
                pinned=c.digest in (self.pinned or ()),
                warm=c.digest in warmed,
                warmed_at=warmed.get(c.digest),
            )
            for c in scan.copies
        ]
        partial = [PartialCopy(digest=p.digest, bytes=p.bytes, copying=p.locked)
                   for p in scan.partials]  # fmt: skip
        return NodeCacheReport(
            node=self.settings.node,
            root=str(self.root),
            budget_bytes=self.settings.budget,
            bytes_held=sum(a.bytes for a in artifacts) + sum(p.bytes for p in partial),
            heartbeat=now,
            artifacts=artifacts,
            partial=partial,
            evictions=self.evictions,
            copy_bytes_per_second=copy_rate(scan.copies),
            interval_seconds=self.settings.interval,
            message="; ".join(messages),
        )

    def _write_status(self, report: NodeCacheReport) -> NodeCacheReport:
        """The report as the NodeCache's status, its heartbeat stamped now (a long pass does
        not make a report look old as it is written). A merge patch: a top-level field that
        became empty is sent as null, else the old value would stay."""
        name = self.settings.node
        path = resource_path(node_cache.API_VERSION, node_cache.PLURAL, name=name)
        report = report.model_copy(update={"heartbeat": self.clock()})
        status: dict[str, Any] = {
            key: None for key, value in report.model_dump(by_alias=True).items() if value is None
        }
        status |= report.model_dump(mode="json", by_alias=True, exclude_none=True)
        try:
            if self.kube.get(path) is None:
                self.kube.create(NODE_CACHES, self._new_object())
            self.kube.merge_patch(f"{path}/status", {"status": status})
        except Exception as e:
            log.warning("cannot write NodeCache %s: %s", name, e)
        return report

    def _new_object(self) -> dict[str, Any]:
        """The NodeCache, owned by its Node when that exists (gone with the node)."""
        metadata: dict[str, Any] = {"name": self.settings.node}
        node = self.kube.get(resource_path("v1", "nodes", name=self.settings.node))
        uid = ((node or {}).get("metadata") or {}).get("uid")
        if uid:
            metadata["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": self.settings.node, "uid": uid}
            ]
        body = NodeCacheObject(metadata=metadata).model_dump(mode="json", by_alias=True)
        body.pop("status", None)
        return body

    def run(self) -> None:
        """Passes every ``interval`` seconds, and sooner when woken (a ModelDeployment's
        change, a finished warm-up), but then never within ``MIN_PASS_GAP`` of the last."""
        watcher = threading.Thread(target=self.watch, name="modelstage-watch", daemon=True)
        watcher.start()
        while not self.stop.is_set():
            self.wake.clear()
            try:
                self.run_pass()
            except Exception:
                log.exception("node cache pass failed; retrying in %.0f s", self.settings.interval)
            ended = time.monotonic()
            if self.wake.wait(self.settings.interval):
                gap = min(MIN_PASS_GAP, self.settings.interval)
                self.stop.wait(max(0.0, gap - (time.monotonic() - ended)))
        self.join_warm()

    def watch(self) -> None:
        """Watches ModelDeployments (cluster-wide) and wakes the loop when what one pins or
        asks this node to warm changed (not on its other status writes: the operator writes
        status as copies progress), so that a warm request or a new pin is acted on without
        waiting for the interval."""
        seen: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        nothing: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        while not self.stop.is_set():
            try:
                for event in self.kube.watch(MD_PATH, WATCH_SECONDS):
                    if self.stop.is_set():
                        return
                    kind, body = event.get("type"), event.get("object") or {}
                    if kind not in ("ADDED", "MODIFIED", "DELETED"):
                        self.wake.set()  # an ERROR: nothing to compare, a pass to be sure
                        continue
                    meta = body.get("metadata") or {}
                    key = f"{meta.get('namespace')}/{meta.get('name')}"
                    interest = nothing if kind == "DELETED" else (
                        frozenset(eviction.pins_of(body)),
                        eviction.warm_requests([body], self.settings.node),
                    )  # fmt: skip
                    if seen.get(key, nothing) != interest:
                        self.wake.set()
                    if interest == nothing:
                        seen.pop(key, None)
                    else:
                        seen[key] = interest
            except Exception as e:
                log.warning("watch of ModelDeployments failed: %s", e)
                self.stop.wait(min(self.settings.interval, WATCH_RETRY_S))


MIN_PASS_GAP = 5.0
"""Least seconds from the end of a pass to a pass that a wake asks for. ModelDeployments'
pins change in bursts (a roll writes several status fields in a row, every node's report makes
the operator write status): without a gap each agent would run a pass per write, each pass
writing its NodeCache status (a new heartbeat), which wakes the operator, which writes status."""
WATCH_SECONDS = 300
"""How long one watch request lasts on the server; then the agent opens the next one."""
WATCH_RETRY_S = 5.0


class AgentMetrics:
    """The agent's Prometheus metrics, on a registry of their own, labelled with the node."""

    def __init__(self, node: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = ["node"]
        self.node = node

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=self.registry).labels(node)

        self.held = gauge(
            "modelstage_node_cache_bytes_held", "Bytes of complete and partial copies."
        )
        self.budget = gauge("modelstage_node_cache_budget_bytes", "The node cache's disk budget.")
        self.artifacts = gauge("modelstage_node_cache_artifacts", "Complete copies held.")
        self.rate = gauge(
            "modelstage_node_cache_copy_bytes_per_second", "The most recent copy's rate."
        )
        self.evictions = Counter(
            "modelstage_node_cache_evictions", "Copies evicted.", labels, registry=self.registry
        ).labels(node)
        self.warm_seconds = Histogram(
            "modelstage_node_cache_warm_seconds",
            "Seconds to read a copy into the page cache.",
            labels,
            registry=self.registry,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
        ).labels(node)

    def serve(self, port: int, address: str) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=address, registry=self.registry)

    def observe(self, report: NodeCacheReport) -> None:
        self.held.set(report.bytes_held)
        self.budget.set(report.budget_bytes)
        self.artifacts.set(len(report.artifacts))
        if report.copy_bytes_per_second is not None:
            self.rate.set(report.copy_bytes_per_second)

    def evicted(self) -> None:
        self.evictions.inc()

    def warmed(self, seconds: float) -> None:
        self.warm_seconds.observe(seconds)


def kube_client(kubeconfig: str | None) -> KubeClient:
    """From ``--kubeconfig`` when given, else in-cluster credentials or ``KUBECONFIG``."""
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    try:
        if kubeconfig is None:
            return KubeClient.from_environment()
        configuration = k8s.Configuration()
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)  # type: ignore[no-untyped-call]
    except (k8s_config.ConfigException, OSError) as e:
        raise SpecError(f"no Kubernetes credentials: {e}") from None
    return KubeClient(k8s.ApiClient(configuration))


def run_agent(settings: AgentSettings) -> int:
    """Run until SIGTERM or SIGINT; 0 then."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not settings.interval > 0:
        raise SpecError(f"--interval {settings.interval}: must be a positive number of seconds")
    try:
        settings.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError(f"--root {settings.root}: {e.strerror or e}") from None
    agent = Agent(settings, kube_client(settings.kubeconfig))
    if settings.metrics_port:
        agent.metrics = AgentMetrics(settings.node)
        try:
            agent.metrics.serve(settings.metrics_port, settings.metrics_address)
        except OSError as e:
            raise SpecError(f"--metrics-port {settings.metrics_port}: {e.strerror or e}") from None

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        agent.stop.set()
        agent.wake.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("node cache agent for node %s, root %s, budget %d bytes",
             settings.node, settings.root, settings.budget)  # fmt: skip
    agent.run()
    return 0
