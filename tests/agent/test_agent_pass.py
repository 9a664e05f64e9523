"""One node agent's passes in process, against a small fake API (a merge patch applied as the
API server applies it): what a pass keeps (the NodeCache's spec, through the copies' grants),
what it reports (copies with grants, sizes from the disk, free bytes, the endpoint), what it
does when the disk is full, a warm-up fails or the root holds entries it cannot read, when the
heartbeat is stamped, that warming does not hold the pass up, that re-verification drops a
copy whose bytes changed, and how often spec changes start a pass."""

from __future__ import annotations

import copy
import errno
import itertools
import json
import os
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
from modelstage.agent.locks import digest_lock
from modelstage.api.kube_client import resource_path
from modelstage.core import node_cache
from modelstage.core.node_cache import content_label
from support.node_agent import fake_digest, make_copy

D1, D2, D3 = (fake_digest(i) for i in range(1, 4))
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
    """The calls the agent makes: its Node, its NodeCache (whose spec is ``spec``)."""

    def __init__(self, spec: dict[str, Any] | None = None) -> None:
        self.objects: dict[str, Any] = {
            NODE_PATH: {"metadata": {"name": NODE, "uid": "uid-1", "labels": {}}}
        }
        if spec is not None:
            self.objects[CACHE_PATH] = {"metadata": {"name": NODE}, "spec": spec}
        self.status_written = threading.Event()
        self.on_get: Any = None
        self.events: list[dict[str, Any]] = []

    def get(self, path: str) -> Any:
        if self.on_get is not None and path == CACHE_PATH:
            self.on_get()
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

    def watch(self, path: str, seconds: int, selector: str | None = None) -> Iterator[dict[str, Any]]:
        yield from self.events

    def status(self) -> dict[str, Any]:
        found: dict[str, Any] = self.objects[CACHE_PATH]["status"]
        return found


def pairs(*given: tuple[str, str]) -> list[dict[str, str]]:
    return [{"namespace": ns, "digest": d} for ns, d in given]


def new_agent(root: Path, kube: FakeKube, budget: int = 10 * SIZE, **kw: Any) -> Agent:
    settings = AgentSettings(node=NODE, root=root, budget=budget, **kw)
    return Agent(settings, cast(Any, kube))


def test_the_report_lists_copies_with_grants_sizes_from_the_disk_and_the_endpoint(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    a = make_copy(root, 1, SIZE, grants=[("team-a", D1), ("team-b", D2)], last_used=T0)
    record = node_cache.state_file(root, a)
    record.write_text(json.dumps(json.loads(record.read_text()) | {"bytes": 10**15}))
    kube = FakeKube(spec={"keep": pairs(("team-b", D2))})
    agent = new_agent(root, kube)
    agent.endpoint = "http://10.0.0.7:9103"
    agent.run_pass()
    status = kube.status()
    manifest_bytes = (node_cache.copy_dir(root, a) / "modelstage.json").stat().st_size
    [held] = status["copies"]
    assert held["content"] == a and held["label"] == content_label(a)
    assert held["bytes"] == SIZE + manifest_bytes == status["bytesHeld"]  # not the record's
    assert held["grants"] == pairs(("team-a", D1), ("team-b", D2)) and held["pinned"] is True
    assert status["endpoint"] == "http://10.0.0.7:9103" and status["freeBytes"] > 0
    assert status["verifyFailures"] == 0 and "artifacts" not in status
    assert kube.objects[NODE_PATH]["metadata"]["labels"] == {content_label(a): "true"}
    assert a not in json.dumps(kube.objects[NODE_PATH]) and D1 not in json.dumps(
        kube.objects[NODE_PATH])  # fmt: skip


def test_nothing_is_evicted_until_the_spec_was_read_and_then_only_unkept_copies(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    kept = make_copy(root, 1, SIZE, grants=[("team-a", D1)], last_used=T0)
    other = make_copy(root, 2, SIZE, grants=[("team-b", D1)], last_used=T0 + timedelta(days=1))
    kube = FakeKube()
    kube.get = lambda path: (_ for _ in ()).throw(OSError("API down"))  # type: ignore[method-assign]
    agent = new_agent(root, kube, budget=SIZE + 500)
    agent.run_pass()
    assert node_cache.copy_dir(root, kept).exists() and node_cache.copy_dir(root, other).exists()
    del kube.get
    kube.objects[CACHE_PATH] = {"metadata": {"name": NODE}, "spec": {"keep": pairs(("team-a", D1))}}
    agent.run_pass()  # the older copy is kept by the spec: the newer, unkept one goes
    assert node_cache.copy_dir(root, kept).exists()
    assert not node_cache.copy_dir(root, other).exists()
    assert kube.status()["evictions"] == 1


def test_a_hostile_entry_is_reported_and_the_pass_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "root"
    real = make_copy(root, 1, SIZE)
    os.mkfifo(root / ("f1" * 16))
    (root / ("e1" * 16)).symlink_to(tmp_path)
    kube = FakeKube(spec={})
    agent = new_agent(root, kube, budget=SIZE * 2)
    agent.run_pass()
    status = kube.status()
    assert [c["content"] for c in status["copies"]] == [real] and status["evictions"] == 0
    assert f"{'f1' * 16}: " in status["message"] and f"{'e1' * 16}: " in status["message"]
    assert kube.objects[NODE_PATH]["metadata"]["labels"] == {content_label(real): "true"}


def test_reverification_drops_a_copy_whose_byte_flipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    good = make_copy(root, 1, 3 * SIZE)
    bad = make_copy(root, 2, 3 * SIZE)
    rank = node_cache.copy_dir(root, bad) / "model.safetensors"
    node_cache.copy_dir(root, bad).chmod(0o750)
    rank.chmod(0o640)
    data = bytearray(rank.read_bytes())
    data[2 * SIZE] ^= 1
    rank.write_bytes(bytes(data))
    kube = FakeKube(spec={})
    agent = new_agent(root, kube, verify_rate=10**9, interval=0.01)
    agent.clock = lambda: T0
    verified = {agent.verify_next(), agent.verify_next()}
    assert verified == {good, bad}
    assert not node_cache.copy_dir(root, bad).exists() and agent.verify_failures == 1
    assert node_cache.copy_dir(root, good).exists()
    record = json.loads(node_cache.state_file(root, good).read_text())
    assert record["lastVerified"] == T0.isoformat()
    assert f"{bad}/model.safetensors: chunk 0 (bytes 0-2999) does not match its hash" in caplog.text
    agent.run_pass()
    status = kube.status()
    assert status["verifyFailures"] == 1
    assert [(c["content"], c["lastVerified"]) for c in status["copies"]] == [
        (good, T0.isoformat().replace("+00:00", "Z"))]  # fmt: skip
    assert agent.verify_next() is None  # verified within its cycle: not again yet


def test_the_verification_pace_keeps_to_the_rate(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make_copy(root, 1, 200_000)
    agent = new_agent(root, FakeKube(spec={}), verify_rate=1_000_000)
    started = time.monotonic()
    agent.verify_next()
    assert time.monotonic() - started >= 0.19


def test_a_full_disk_still_evicts_labels_and_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording a pinned copy's use needs a write; with the disk full that write fails, and
    the eviction that would free the disk still runs, and the node is labelled and reported."""
    root = tmp_path / "root"
    A = make_copy(root, 1, SIZE, last_used=T0)
    B = make_copy(root, 2, SIZE, last_used=T0)
    kube = FakeKube(spec={"keep": pairs(("ns", D1))})

    def full(path: Path, data: bytes, mode: int = 0o600) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write_atomic", full)
    agent = new_agent(root, kube, budget=SIZE + 500)
    agent.run_pass()
    assert not node_cache.copy_dir(root, B).exists()  # evicted: the disk gets space back
    assert (node_cache.copy_dir(root, A) / "modelstage.json").exists()
    status = kube.status()
    assert [a["content"] for a in status["copies"]] == [A] and status["evictions"] == 1
    assert f"cannot record the use of {A}" in status["message"]
    assert "No space left on device" in status["message"]
    assert kube.objects[NODE_PATH]["metadata"]["labels"] == {content_label(A): "true"}


def test_the_heartbeat_is_when_the_report_is_written(tmp_path: Path) -> None:
    """A pass that takes long (a slow API, a big eviction) reports a heartbeat of when it
    wrote, not of when it began; the report carries the agent's interval."""
    root = tmp_path / "root"
    make_copy(root, 1, SIZE)
    kube = FakeKube(spec={})
    clock = [T0]
    kube.on_get = lambda: clock.__setitem__(0, T0 + timedelta(hours=1))
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
    A = make_copy(root, 1, SIZE)
    kube = FakeKube(spec={"warm": pairs(("ns", D1))})
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
    assert status["copies"][0]["warm"] is True and "warming" not in status["message"]


def test_a_warm_error_is_reported_and_the_pass_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that cannot be read fails its own warm-up: the others are warmed, the node is
    labelled and reported, the error is in the report, and it is retried once an interval."""
    root = tmp_path / "root"
    A = make_copy(root, 1, SIZE)
    B = make_copy(root, 2, SIZE)
    if A > B:
        A, B = B, A
    kube = FakeKube(spec={"warm": pairs(("ns", D1), ("ns", D2))})
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
    assert {a["content"]: a["warm"] for a in status["copies"]} == {A: False, B: True}
    assert f"{A}: cannot warm: " in status["message"] and "Input/output error" in status["message"]
    assert calls == [A, B]
    assert kube.objects[NODE_PATH]["metadata"]["labels"] == {
        content_label(A): "true", content_label(B): "true"}  # fmt: skip


def test_a_field_that_became_empty_is_cleared(tmp_path: Path) -> None:
    root = tmp_path / "root"
    A = make_copy(root, 1, SIZE)
    kube = FakeKube(spec={})
    agent = new_agent(root, kube)
    agent.run_pass()
    held = kube.status()["bytesHeld"]
    assert kube.status()["copyBytesPerSecond"] == held / 2.0
    store.remove_tree(node_cache.copy_dir(root, A))  # gone: no copy's rate to report
    agent.run_pass()
    assert "copyBytesPerSecond" not in kube.status()


def test_watch_events_start_passes_at_least_the_gap_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spec changes without pause (each event a new pair): passes still come at least
    ``MIN_PASS_GAP`` apart."""
    gap = 0.2
    monkeypatch.setattr(agent_module, "MIN_PASS_GAP", gap, raising=False)
    root = tmp_path / "root"
    root.mkdir()
    kube = FakeKube(spec={})
    agent = new_agent(root, kube, interval=3600.0, verify_rate=0)
    events = iter(range(10**9))

    def changing(path: str, seconds: int, selector: str | None = None) -> Iterator[dict[str, Any]]:
        for i in events:
            if agent.stop.is_set():
                return
            time.sleep(0.001)
            yield {"type": "MODIFIED", "object": nodecache({"keep": pairs(("ns", fake_digest(i % 200)))})}

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


def nodecache(spec: dict[str, Any], name: str = NODE) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": spec, "status": {"heartbeat": "x"}}


def test_the_watch_wakes_the_loop_only_when_its_own_spec_changes(tmp_path: Path) -> None:
    kube = FakeKube()
    agent = new_agent(tmp_path, kube)
    agent.wake = CountingEvent()
    keep = {"keep": pairs(("ns", D1))}
    kube.events = [
        {"type": "ADDED", "object": nodecache(keep)},  # the first spec: wakes
        {"type": "MODIFIED", "object": {**nodecache(keep), "status": {"heartbeat": "y"}}},
        {"type": "MODIFIED", "object": nodecache({"keep": pairs(("ns", D2))}, name="other")},
        {"type": "MODIFIED", "object": nodecache({**keep, "warm": pairs(("ns", D1))})},  # wakes
        {"type": "MODIFIED", "object": nodecache({**keep, "warm": pairs(("ns", D1))})},
        {"type": "DELETED", "object": nodecache({})},  # wakes: a pass recreates it
    ]
    selectors: list[str | None] = []

    def watch_once(path: str, seconds: int, selector: str | None = None) -> Iterator[dict[str, Any]]:
        selectors.append(selector)
        yield from kube.events
        agent.stop.set()

    kube.watch = watch_once  # type: ignore[method-assign]
    agent.watch()
    assert cast(CountingEvent, agent.wake).count == 3
    assert selectors == [f"metadata.name={NODE}"]


def test_touch_keeps_what_the_copier_recorded_and_waits_for_no_copier(tmp_path: Path) -> None:
    root = tmp_path / "root"
    A = make_copy(root, 1, SIZE)
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
    with digest_lock(node_cache.lock_file(root, A)):  # a commit or a verification of A
        store.touch(root, seen, T0 + timedelta(hours=1))
    assert json.loads(state.read_text()) == on_disk
