"""``modelstage agent``: the node cache's DaemonSet process, one per node.

It serves the copy protocol (``server.py``: copy Jobs stream artifacts to it, every chunk
verified), and each pass: reads its own ``NodeCache``'s spec (what the operator asks it to keep
and warm: (namespace, digest) pairs, mapped to copies through the grants recorded with them),
scans the root (hostile entries reported and skipped), evicts least recently used unkept copies
while over the budget (``eviction.py`` decides), records the use of kept copies, starts warming
what is asked for (a thread of its own), labels its node with the opaque label of each copy
(only its own node, only labels under ``core.node_cache.LABEL_PREFIX``) and writes the
NodeCache's status (the report, with a heartbeat) and its metrics. Until the spec was read
once, nothing is evicted (what is kept is unknown). A thread of its own re-reads every copy at
``--verify-rate`` bytes per second, oldest verification first, and drops a copy that no longer
matches its manifest. SIGTERM (or SIGINT) ends the loop between passes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from modelstage.api.kube_client import KubeClient, resource_path
from modelstage.api.nodecache import (
    Grant,
    HeldCopy,
    NodeCacheObject,
    NodeCacheReport,
    NodeCacheSpec,
    PartialCopy,
)
from modelstage.core import node_cache
from modelstage.core.errors import ModelstageError, SpecError

from . import eviction, store
from .auth import TokenReviewer
from .receive import Receiver
from .server import CopyServer

log = logging.getLogger("modelstage.agent")
NODE_CACHES = resource_path(node_cache.API_VERSION, node_cache.PLURAL)
MAX_MESSAGES = 20
"""Problems listed in the report's message at most (the rest counted)."""


@dataclass(frozen=True)
class AgentSettings:
    node: str
    root: Path
    budget: int
    interval: float = 10.0
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"
    kubeconfig: str | None = None
    copy_address: str = "127.0.0.1"
    copy_port: int = node_cache.DEFAULT_COPY_PORT
    """0: any free port (tests); the report's ``endpoint`` says which."""
    namespace_quota: int = 0
    verify_rate: float = 50e6
    """Bytes per second re-verification reads (0: off)."""
    allow_tokens_without_node: bool = False


def label_patch(current: Mapping[str, str], held: Iterable[str]) -> dict[str, str | None]:
    """The merge patch of a node's labels that makes its cache labels say exactly ``held``
    (contents): only keys under the cache prefix, ever (other labels are not ours)."""
    want = {node_cache.content_label(c) for c in held}
    have = {k for k, v in current.items() if k.startswith(node_cache.LABEL_PREFIX)}
    patch: dict[str, str | None] = {k: "true" for k in sorted(want) if current.get(k) != "true"}
    patch |= {k: None for k in sorted(have - want)}
    assert all(k.startswith(node_cache.LABEL_PREFIX) for k in patch)
    return patch


_when = store.record_time


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


def contents_for(pairs: Iterable[Grant], copies: Iterable[store.Copy]) -> frozenset[str]:
    """The copies granted to any of the (namespace, digest) ``pairs``."""
    wanted = {(g.namespace, g.digest) for g in pairs}
    return frozenset(c.content for c in copies if wanted & set(c.grants))


def utc_now() -> datetime:
    return datetime.now(UTC)


def _free_bytes(root: Path) -> int | None:
    try:
        stats = os.statvfs(root)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


@dataclass
class Agent:
    settings: AgentSettings
    kube: KubeClient
    stop: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)
    """Set by a change of the NodeCache's spec (the watch), a commit, a finished warm-up or
    ``stop``: the next pass soon (``MIN_PASS_GAP``)."""
    spec: NodeCacheSpec | None = None
    """The NodeCache's spec as last read (None: never read yet)."""
    receiver: Receiver | None = None
    endpoint: str | None = None
    warmed: dict[str, datetime] = field(default_factory=dict)
    warm_failed: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Warm-ups that failed: when (monotonic) and why; retried once an interval."""
    warming: str | None = None
    """The content the warm-up thread reads now."""
    evictions: int = 0
    verify_failures: int = 0
    metrics: Any = None
    clock: Callable[[], datetime] = utc_now
    _warm_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _warmer: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.receiver is None:
            self.receiver = Receiver(
                self.settings.root, self.settings.node, self.settings.budget,
                self.settings.namespace_quota, on_commit=self.wake.set, keep=self._kept_pairs,
                refresh_keep=lambda: self._read_spec([]), on_evict=self._evicted_for_offer,
            )  # fmt: skip

    @property
    def root(self) -> Path:
        return self.settings.root

    def run_pass(self) -> NodeCacheReport:
        now = self.clock()
        messages: list[str] = []
        self._read_spec(messages)
        try:
            scan = store.scan(self.root)
        except OSError as e:  # the report says so; the next pass tries again
            messages.append(f"cannot read the root {self.root}: {e.strerror or e}")
            return self._write_status(self._report(store.Scan(), now, messages))
        messages += [f"removed an incomplete copy {r}" for r in scan.removed]
        messages += scan.problems
        scan = self._keep_within_budget(scan, now, messages)
        held = {c.content for c in scan.copies}
        if self.spec is not None:
            # Warm while asked: a request that ended forgets it, so a later one reads it again.
            self._warm(contents_for(self.spec.warm, scan.copies) & held, messages)
        with self._warm_lock:
            self.warmed = {d: t for d, t in self.warmed.items() if d in held}
        self._label(held, messages)
        report = self._write_status(self._report(scan, now, messages))
        if self.metrics is not None:
            self.metrics.observe(report)
        return report

    def _read_spec(self, messages: list[str]) -> None:
        """The NodeCache's spec now (created without one when missing, so the operator can
        write it); when it cannot be read, the last one read stays."""
        path = resource_path(node_cache.API_VERSION, node_cache.PLURAL, name=self.settings.node)
        try:
            body = self.kube.get(path)
            if body is None:
                self.kube.create(NODE_CACHES, self._new_object())
                body = {}
            self.spec = NodeCacheSpec.model_validate(body.get("spec") or {})
        except Exception as e:
            messages.append(f"cannot read NodeCache {self.settings.node}: {e}")
            log.warning("cannot read NodeCache %s: %s", self.settings.node, e)

    def _kept_pairs(self) -> frozenset[store.GrantKey] | None:
        """What the spec keeps, for an offer's eviction (None before the spec was read)."""
        spec = self.spec
        return None if spec is None else frozenset((g.namespace, g.digest) for g in spec.keep)

    def _evicted_for_offer(self, content: str) -> None:
        self.evictions += 1
        if self.metrics is not None:
            self.metrics.evicted()
        log.info("evicted %s (least recently used) to make room for a copy", content)
        self.wake.set()

    def _pinned(self, copies: Iterable[store.Copy]) -> frozenset[str]:
        return contents_for(self.spec.keep if self.spec else (), copies)

    def _keep_within_budget(
        self, scan: store.Scan, now: datetime, messages: list[str]
    ) -> store.Scan:
        """Evicts what the planner says, then records the use of kept copies (in that order:
        on a full disk the record cannot be written, and eviction is what frees the disk; a
        kept copy is never evicted, so its old ``lastUsed`` does not matter here); the
        root's scan after that."""
        if self.spec is None:
            messages.append("not evicting: the NodeCache's spec has not been read yet")
            return scan
        pins = self._pinned(scan.copies)
        receiving = self.receiver.active() if self.receiver is not None else set()
        plan = eviction.plan_eviction(
            [eviction.HeldCopy(c.content, c.bytes, _when(c.record.get("lastUsed")),
                               c.content in pins) for c in scan.copies],
            [eviction.PartialCopy(p.content, p.bytes, p.content in receiving
                                  or store.partial_locked(self.root, p.content))
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
            if c.content in pins:
                c, why = store.touch(self.root, c, now)
                if why:
                    messages.append(why)
                    log.warning("%s", why)
            copies.append(c)
        scan.copies = copies
        return scan

    def _evict(self, plan: eviction.EvictionPlan, messages: list[str]) -> None:
        for content in plan.evict:
            if store.remove_copy(self.root, content):
                self.evictions += 1
                if self.metrics is not None:
                    self.metrics.evicted()
                log.info("evicted %s (least recently used, over budget)", content)
            else:
                messages.append(f"{content}: not evicted, it is being written or verified")
        for content in plan.drop_partials:
            if store.remove_partial(self.root, content):
                log.info("removed the abandoned partial copy of %s", content)

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
        pins = self._pinned(scan.copies)
        copies = [
            HeldCopy(
                content=c.content,
                label=node_cache.content_label(c.content),
                bytes=c.bytes,
                files=c.files,
                copied_at=_when(c.record.get("copiedAt")),
                copy_seconds=_number(c.record.get("copySeconds")),
                last_used=_when(c.record.get("lastUsed")),
                last_verified=_when(c.record.get("lastVerified")),
                pinned=c.content in pins,
                warm=c.content in warmed,
                warmed_at=warmed.get(c.content),
                grants=[Grant(namespace=ns, digest=d) for ns, d in c.grants],
            )
            for c in scan.copies
        ]
        receiving = self.receiver.active() if self.receiver is not None else set()
        partial = [PartialCopy(content=p.content, bytes=p.bytes, copying=p.content in receiving
                               or store.partial_locked(self.root, p.content))
                   for p in scan.partials]  # fmt: skip
        if len(messages) > MAX_MESSAGES:
            messages = [*messages[:MAX_MESSAGES], f"and {len(messages) - MAX_MESSAGES} more"]
        return NodeCacheReport(
            node=self.settings.node,
            root=str(self.root),
            budget_bytes=self.settings.budget,
            bytes_held=scan.bytes,
            free_bytes=_free_bytes(self.root),
            endpoint=self.endpoint,
            heartbeat=now,
            copies=copies,
            partial=partial,
            evictions=self.evictions,
            verify_failures=self.verify_failures,
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

    def verify_next(self) -> str | None:
        """Re-verify the copy verified longest ago (never first), unless every copy was
        verified within one cycle (all bytes held at the rate, at least an interval); the
        content verified, or None when none was due."""
        rate = self.settings.verify_rate
        try:
            scan = store.scan(self.root)
        except OSError:
            return None
        if rate <= 0 or not scan.copies:
            return None
        oldest = datetime.min.replace(tzinfo=UTC)
        copy = min(
            scan.copies, key=lambda c: (_when(c.record.get("lastVerified")) or oldest, c.content)
        )
        last = _when(copy.record.get("lastVerified"))
        cycle = max(self.settings.interval, scan.bytes / rate)
        if last is not None and (self.clock() - last).total_seconds() < cycle:
            return None
        why = store.verify_copy(self.root, copy.content, store.Pace(rate, self.stop))
        if self.stop.is_set():
            return None
        if why:
            self._drop_corrupt(copy.content, why)
        else:
            stamp = self.clock().isoformat()
            try:
                store.update_record(self.root, copy.content,
                                    lambda r: r.__setitem__("lastVerified", stamp))  # fmt: skip
            except OSError as e:
                log.warning("cannot record the verification of %s: %s", copy.content, e)
        return copy.content

    def _drop_corrupt(self, content: str, why: str) -> None:
        log.error("re-verification failed: %s; removing the copy (a copy Job copies it again)",
                  why)  # fmt: skip
        if store.remove_copy(self.root, content):
            self.verify_failures += 1
            if self.metrics is not None:
                self.metrics.verify_failed()
            self.wake.set()

    def verify_loop(self) -> None:
        while not self.stop.is_set():
            try:
                done = self.verify_next()
            except Exception:
                log.exception("re-verification failed")
                done = None
            if done is None:
                self.stop.wait(self.settings.interval)

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
        body["spec"] = {}  # the operator's to write
        return body

    def run(self) -> None:
        """Passes every ``interval`` seconds, and sooner when woken (the spec changed, a copy
        was committed, a warm-up finished), but then never within ``MIN_PASS_GAP`` of the
        last."""
        threads = [threading.Thread(target=self.watch, name="modelstage-watch", daemon=True),
                   threading.Thread(target=self.verify_loop, name="modelstage-verify",
                                    daemon=True)]  # fmt: skip
        for thread in threads:
            thread.start()
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
        """Watches this node's NodeCache and wakes the loop when its spec changed (not on the
        agent's own status writes)."""
        selector = f"metadata.name={self.settings.node}"
        while not self.stop.is_set():
            try:
                for event in self.kube.watch(NODE_CACHES, WATCH_SECONDS, selector):
                    if self.stop.is_set():
                        return
                    body = event.get("object") or {}
                    if (body.get("metadata") or {}).get("name") != self.settings.node:
                        continue
                    if event.get("type") not in ("ADDED", "MODIFIED"):
                        self.wake.set()
                        continue
                    spec = NodeCacheSpec.model_validate(body.get("spec") or {})
                    if spec != self.spec:
                        self.spec = spec
                        self.wake.set()
            except Exception as e:
                log.warning("watch of NodeCache %s failed: %s", self.settings.node, e)
                self.stop.wait(min(self.settings.interval, WATCH_RETRY_S))


MIN_PASS_GAP = 5.0
"""Least seconds from the end of a pass to a pass that a wake asks for. The spec changes in
bursts (the operator writes it as each node's report comes in): without a gap each agent would
run a pass per write, each pass writing its status (a new heartbeat), which wakes the
operator, which writes the spec."""
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
        self.copies = gauge("modelstage_node_cache_artifacts", "Complete copies held.")
        self.rate = gauge(
            "modelstage_node_cache_copy_bytes_per_second", "The most recent copy's rate."
        )
        self.evictions = Counter(
            "modelstage_node_cache_evictions", "Copies evicted.", labels, registry=self.registry
        ).labels(node)
        self.verify_failures = Counter(
            "modelstage_node_cache_verify_failures",
            "Copies dropped because re-verification found a chunk that did not match.",
            labels,
            registry=self.registry,
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
        self.copies.set(len(report.copies))
        if report.copy_bytes_per_second is not None:
            self.rate.set(report.copy_bytes_per_second)

    def evicted(self) -> None:
        self.evictions.inc()

    def verify_failed(self) -> None:
        self.verify_failures.inc()

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
    kube = kube_client(settings.kubeconfig)
    agent = Agent(settings, kube)
    server = start_copy_server(agent, kube)
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
    try:
        agent.run()
    finally:
        server.shutdown()
        server.server_close()
    return 0


def start_copy_server(agent: Agent, kube: KubeClient) -> CopyServer:
    """The copy protocol's server on ``--copy-address:--copy-port``, started; the agent's
    ``endpoint`` says where it listens."""
    settings = agent.settings
    reviewer = TokenReviewer(kube, settings.node, settings.allow_tokens_without_node)
    assert agent.receiver is not None
    try:
        server = CopyServer((settings.copy_address, settings.copy_port), agent.receiver, reviewer)
    except OSError as e:
        raise SpecError(
            f"--copy-address {settings.copy_address} --copy-port {settings.copy_port}: "
            f"{e.strerror or e}"
        ) from None
    agent.endpoint = server.url
    server.start()
    log.info("receiving copies on %s", server.url)
    return server
