"""One node agent's passes in process, against a small fake API (a merge patch applied as the
API server applies it): what a pass does when the disk is full or a warm-up fails, when the
heartbeat is stamped, that warming does not hold the pass up, that a field which became empty
is cleared, and how often ModelDeployment events start a pass."""

from __future__ import annotations

import copy
import errno
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from modelstage.agent import agent as agent_module
from modelstage.agent import store
from modelstage.agent.agent import Agent, AgentSettings
from modelstage.agent.locks import digest_lock, write_atomic
from modelstage.core import node_cache
from modelstage.core.node_cache import node_label
from modelstage.operator.kube_client import resource_path
from support.node_agent import fake_digest, make_copy

A, B, C = (fake_digest(i) for i in range(1, 4))
NODE = "node-1"
SIZE = 1000
T0 = datetime(2026, 1, 1, tzinfo=UTC)
NODE_PATH = resource_path("v1", "nodes", name=NODE)
CACHE_PATH = resource_path(node_cache.API_VERSION, node_cache.PLURAL, name=NODE)


def merged(target: Any, patch: Any) -> Any:
    """RFC 7386: what a JSON merge patch makes of ``target`` (null removes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merged(out.get(key), value)
    return out


class FakeKube:
    """The calls the agent makes; ModelDeployments are what ``mds`` holds at each list."""

    def __init__(self, mds: list[dict[str, Any]] | None = None) -> None:
        self.objects: dict[str, Any] = {
            NODE_PATH: {"metadata": {"name": NODE, "uid": "uid-1", "labels": {}}}
        }
        self.mds = mds or []
        self.status_written = threading.Event()
        self.on_list: Any = None
        self.events: list[dict[str, Any]] = []

    def list(self, path: str) -> list[dict[str, Any]]:
        if self.on_list is not None:
            self.on_list()
        return copy.deepcopy(self.mds)

    def get(self, path: str) -> Any:
        return copy.deepcopy(self.objects.get(path))

    def create(self, path: str, body: dict[str, Any]) -> Any:
        name = f"{path}/{body['metadata']['name']}"
        if name in self.objects:
            return None
        self.objects[name] = copy.deepcopy(body)
        return body

    def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        target = path.removesuffix("/status")
        self.objects[target] = merged(self.objects[target], patch)
        if target != path:
            self.status_written.set()
        return self.objects[target]

    def watch(self, path: str, seconds: int) -> Iterator[dict[str, Any]]:
        yield from self.events

    def status(self) -> dict[str, Any]:
        found: dict[str, Any] = self.objects[CACHE_PATH]["status"]
        return found


def md(name: str, status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name}, "spec": {}, "status": status}


def warming(digest: str, node: str = NODE) -> dict[str, Any]:
    return {"desiredDigest": digest, "nodeCache": {
        "digest": digest, "phase": "Warming", "nodes": [{"name": node, "state": "Ready"}]}}  # fmt: skip


def new_agent(root: Path, kube: FakeKube, budget: int = 10 * SIZE, **kw: Any) -> Agent:
    settings = AgentSettings(node=NODE, root=root, budget=budget, **kw)
    return Agent(settings, cast(Any, kube))


def test_a_full_disk_still_evicts_labels_and_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording a pinned copy's use needs a write; with the disk full that write fails, and
    the eviction that would free the disk still runs, and the node is labelled and reported."""
    root = tmp_path / "root"
    make_copy(root, A, SIZE, last_used=T0)
    make_copy(root, B, SIZE, last_used=T0)
    kube = FakeKube([md("served", {"desiredDigest": A})])

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write_atomic", full)
    agent = new_agent(root, kube, budget=SIZE)
    agent.run_pass()
    assert not node_cache.copy_dir(root, B).exists()  # evicted: the disk gets space back
    assert (node_cache.copy_dir(root, A) / "modelstage.json").exists()
    status = kube.status()
    assert [a["digest"] for a in status["artifacts"]] == [A] and status["evictions"] == 1
    assert f"cannot record the use of {A}" in status["message"]
    assert "No space left on device" in status["message"]
    assert kube.objects[NODE_PATH]["metadata"]["labels"] == {node_label(A): "true"}


def test_the_heartbeat_is_when_the_report_is_written(tmp_path: Path) -> None:
    """A pass that takes long (a slow API, a big eviction) reports a heartbeat of when it
    wrote, not of when it began; the report carries the agent's interval."""
    root = tmp_path / "root"
    make_copy(root, A, SIZE)
    kube = FakeKube()
    clock = [T0]
    kube.on_list = lambda: clock.__setitem__(0, T0 + timedelta(hours=1))
    agent = new_agent(root, kube, interval=600.0)
    agent.clock = lambda: clock[0]
    agent.run_pass()
    status = kube.status()
    assert datetime.fromisoformat(status["heartbeat"]) == T0 + timedelta(hours=1)
    assert status["intervalSeconds"] == 600.0


def test_warming_does_not_hold_the_report_up_and_wakes_the_loop_when_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm-up of a large artifact takes minutes: the pass writes its report (saying it is
    warming) while the warm-up runs, and a finished warm-up starts the next pass."""
    root = tmp_path / "root"
    make_copy(root, A, SIZE)
    kube = FakeKube([md("rolling", warming(A))])
    reported_first: list[bool] = []

    def slow_warm(root: Path, digest: str, stop: Any = None) -> float:
        reported_first.append(kube.status_written.wait(30))
        return 1.0

    monkeypatch.setattr(store, "warm", slow_warm)
    agent = new_agent(root, kube, interval=3600.0)
    agent.run_pass()
    assert f"warming {A}" in kube.status()["message"]
    agent.join_warm()
    assert reported_first == [True]
    assert agent.wake.is_set()
    agent.run_pass()
    status = kube.status()
    assert status["artifacts"][0]["warm"] is True and "warming" not in status["message"]


def test_a_warm_error_is_reported_and_the_pass_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that cannot be read fails its own warm-up: the others are warmed, the node is
    labelled and reported, the error is in the report, and it is retried once an interval."""
    root = tmp_path / "root"
    make_copy(root, A, SIZE)
    make_copy(root, B, SIZE)
    kube = FakeKube([md("a", warming(A)), md("b", warming(B))])
    calls: list[str] = []

    def warm(root: Path, digest: str, stop: Any = None) -> float:
        calls.append(digest)
        if digest == A:
            raise OSError(errno.EIO, "Input/output error")
        return 1.0

    monkeypatch.setattr(store, "warm", warm)
    agent = new_agent(root, kube, interval=3600.0)
    for _ in range(3):
        agent.run_pass()
        agent.join_warm()
    status = kube.status()
    assert {a["digest"]: a["warm"] for a in status["artifacts"]} == {A: False, B: True}
    assert f"{A}: cannot warm: " in status["message"] and "Input/output error" in status["message"]
    assert calls == [A, B]
    assert kube.objects[NODE_PATH]["metadata"]["labels"] == {
        node_label(A): "true", node_label(B): "true"}  # fmt: skip


def test_a_field_that_became_empty_is_cleared(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make_copy(root, A, SIZE)
    kube = FakeKube()
    agent = new_agent(root, kube)
    agent.run_pass()
    assert kube.status()["copyBytesPerSecond"] == SIZE / 2.0
    shutil.rmtree(node_cache.copy_dir(root, A))  # gone: no copy's rate to report
    agent.run_pass()
    assert "copyBytesPerSecond" not in kube.status()


def test_watch_events_start_passes_at_least_the_gap_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModelDeployments change without pause (each event a new pin): passes still come at
    least ``MIN_PASS_GAP`` apart."""
    gap = 0.2
    monkeypatch.setattr(agent_module, "MIN_PASS_GAP", gap, raising=False)
    root = tmp_path / "root"
    root.mkdir()
    kube = FakeKube()
    agent = new_agent(root, kube, interval=3600.0)
    events = iter(range(10**9))

    def changing(path: str, seconds: int) -> Iterator[dict[str, Any]]:
        for i in events:
            if agent.stop.is_set():
                return
            time.sleep(0.001)
            yield {"type": "MODIFIED", "object": md("m", {"desiredDigest": fake_digest(i % 200)})}

    kube.watch = changing  # type: ignore[method-assign]
    started: list[float] = []
    enough = threading.Event()
    run_pass = agent.run_pass

    def counted() -> Any:
        started.append(time.monotonic())
        if len(started) >= 4:
            enough.set()
        return run_pass()

    agent.run_pass = counted  # type: ignore[method-assign]
    loop = threading.Thread(target=agent.run)
    loop.start()
    try:
        assert enough.wait(60), "fewer than 4 passes"
    finally:
        agent.stop.set()
        agent.wake.set()
        loop.join()
    gaps = [b - a for a, b in itertools.pairwise(started)]
    assert min(gaps) >= gap, gaps


class CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def set(self) -> None:
        self.count += 1
        super().set()


def test_the_watch_wakes_the_loop_only_when_pins_or_warm_requests_change(
    tmp_path: Path,
) -> None:
    kube = FakeKube()
    agent = new_agent(tmp_path, kube)
    agent.wake = CountingEvent()

    def event(kind: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "object": md(name, status)}

    kube.events = [
        event("ADDED", "m1", {"desiredDigest": A}),  # a new pin: wakes
        event("MODIFIED", "m1", {"desiredDigest": A, "message": "1.2 GB so far"}),
        event("ADDED", "m3", {}),  # pins nothing
        event("ADDED", "m2", {"desiredDigest": B}),  # wakes
        event("MODIFIED", "m2", warming(B, node="elsewhere")),  # not this node's request
        event("MODIFIED", "m2", warming(B)),  # wakes
        event("MODIFIED", "m2", {**warming(B), "phase": "Staging"}),
        event("DELETED", "m1", {"desiredDigest": A}),  # a pin gone: wakes
    ]

    def watch_once(path: str, seconds: int) -> Iterator[dict[str, Any]]:
        yield from kube.events
        agent.stop.set()

    kube.watch = watch_once  # type: ignore[method-assign]
    agent.watch()
    assert cast(CountingEvent, agent.wake).count == 4


def test_write_atomic_leaves_another_writers_temporary_file_alone(tmp_path: Path) -> None:
    """The copy Job and the agent are both likely PID 1 in their containers: a temporary name
    from the PID would be the same for both."""
    path = tmp_path / "record.json"
    theirs = tmp_path / f".record.json.{os.getpid()}.tmp"
    theirs.write_bytes(b'{"half": ')
    write_atomic(path, b'{"whole": 1}')
    assert json.loads(path.read_bytes()) == {"whole": 1}
    assert theirs.read_bytes() == b'{"half": '
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, path.name]


def test_touch_keeps_what_the_copier_recorded_and_waits_for_no_copier(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make_copy(root, A, SIZE)
    state = node_cache.state_file(root, A)
    recorded = state.read_text()
    state.unlink()
    (seen,) = store.scan(root).copies  # scanned between the copier's rename and its record
    assert seen.record == {}
    state.write_text(recorded)
    touched, why = store.touch(root, seen, T0)
    assert why == ""
    on_disk = json.loads(state.read_text())
    assert on_disk["copiedAt"] == "2026-01-01T00:00:00+00:00" and on_disk["copySeconds"] == 2.0
    assert on_disk["lastUsed"] == T0.isoformat() and touched.record == on_disk
    with digest_lock(node_cache.lock_file(root, A)):  # a copier re-checking or writing A
        store.touch(root, seen, T0 + timedelta(hours=1))
    assert json.loads(state.read_text()) == on_disk
