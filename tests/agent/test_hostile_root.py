"""A root that someone else wrote into: a FIFO, a link and a directory without permissions
where copies are expected, a record claiming 10^15 bytes. Each is reported and skipped, the
scan goes on with the real copy (its size from the disk), nothing hangs, nothing real is
evicted; ``prepare``'s verdict and the manifest reader neither follow the link nor wait on
the FIFO. Each check runs in a forked child with a deadline (a FIFO that blocks would hang it)
as the agent's own user (uid 65532), as the chart runs it: root reads a 000 directory."""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from modelstage.agent import eviction, store
from modelstage.core import node_cache
from modelstage.core.errors import ArtifactError
from modelstage.core.manifest import MANIFEST, read_manifest_bytes
from modelstage.plugin.node_copy import check_node_copy
from support.node_agent import copy_manifest, fake_digest, make_copy

AGENT_UID = node_cache.CACHE_GID
DEADLINE_S = 20.0


def in_child(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child as the agent's user, within ``DEADLINE_S``; its result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            if os.getuid() == 0:
                os.setgroups([])
                os.setgid(AGENT_UID)
                os.setuid(AGENT_UID)
            out = pickle.dumps(("ok", fn()))
        except BaseException as e:
            out, code = pickle.dumps(("error", repr(e))), 1
        with os.fdopen(w, "wb") as f:
            f.write(out)
        os._exit(code)
    os.close(w)
    data = b""
    try:
        while True:
            ready, _, _ = select.select([r], [], [], DEADLINE_S)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the check hung for {DEADLINE_S} s (a FIFO waited on?)")
            block = os.read(r, 1 << 16)
            if not block:
                break
            data += block
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    assert kind == "ok", value
    return value


@pytest.fixture
def root() -> Iterator[Path]:
    """A root the agent's user owns, under a directory it can reach."""
    top = Path(tempfile.mkdtemp(prefix="modelstage-hostile-"))
    top.chmod(0o755)
    root = top / "root"
    root.mkdir()
    yield root
    for directory, _, _ in os.walk(top):
        os.chmod(directory, 0o700)
    import shutil

    shutil.rmtree(top)


def give_to_agent(root: Path) -> None:
    if os.getuid() == 0:
        for directory, dirs, files in os.walk(root):
            for name in [*dirs, *files]:
                os.chown(os.path.join(directory, name), AGENT_UID, AGENT_UID, follow_symlinks=False)
        os.chown(root, AGENT_UID, AGENT_UID)


def hostile(root: Path, elsewhere: Path) -> dict[str, str]:
    """The hostile entries, by what they are; the real copy is ``real``."""
    names = {"real": make_copy(root, 1, 3000, grants=[("a", fake_digest(1))])}
    names["fifo"] = "f1" * 16
    os.mkfifo(root / names["fifo"])
    names["link"] = "e1" * 16
    target = elsewhere / "target"
    target.mkdir()
    (target / "keep").write_text("not the agent's")
    (root / names["link"]).symlink_to(target)
    names["closed"] = "d1" * 16
    (root / names["closed"]).mkdir(mode=0o000)
    names["fifo-manifest"] = "c1" * 16
    (root / names["fifo-manifest"]).mkdir()
    os.mkfifo(root / names["fifo-manifest"] / MANIFEST)
    names["fake"] = "b1" * 16
    state = node_cache.state_file(root, names["real"])
    record = json.loads(state.read_text()) | {"bytes": 10**15}
    state.write_text(json.dumps(record))
    node_cache.state_file(root, names["fake"]).write_text(json.dumps({"bytes": 10**15}))
    partial = root / node_cache.PARTIAL
    partial.mkdir(exist_ok=True)
    os.mkfifo(partial / ("a1" * 16))
    give_to_agent(root)
    (root / names["closed"]).chmod(0o000)
    return names


def test_a_fifo_a_link_and_a_closed_directory_are_reported_and_the_scan_goes_on(
    root: Path,
) -> None:
    names = hostile(root, root.parent)

    def scan() -> dict[str, Any]:
        found = store.scan(root)
        plan = eviction.plan_eviction(
            [eviction.HeldCopy(c.content, c.bytes) for c in found.copies], [], 4000
        )
        return {"copies": [(c.content, c.bytes, c.grants) for c in found.copies],
                "problems": found.problems, "removed": found.removed,
                "bytes": found.bytes, "evict": plan.evict}  # fmt: skip

    result = in_child(scan)
    real_bytes = 3000 + len((root / names["real"] / MANIFEST).read_bytes())
    assert result["copies"] == [(names["real"], real_bytes, [("a", fake_digest(1))])]
    assert result["bytes"] == real_bytes  # from the disk: the records' 10^15 are not read
    assert result["evict"] == ()  # within its budget: nothing real goes
    problems = " | ".join(result["problems"])
    for what in ("fifo", "link", "closed", "fifo-manifest"):
        assert f"{names[what]}: " in problems, (what, problems)
    assert "Permission denied" in problems and "skipped" in problems
    assert (root.parent / "target" / "keep").exists()  # the link's target is never touched
    assert (root / names["link"]).is_symlink() and (root / names["fifo"]).exists()
    assert f"{names['fifo-manifest']}: not a regular file; skipped" in problems


def test_prepare_neither_follows_a_link_nor_waits_on_a_fifo(root: Path) -> None:
    content = make_copy(root, 2, 2000)
    copy = node_cache.copy_dir(root, content)
    copy.chmod(0o750)
    data = (copy / "model.safetensors").read_bytes()
    artifact_manifest = copy_manifest(fake_digest(2), data)
    manifest = copy / MANIFEST
    canonical = manifest.read_bytes()
    assert check_node_copy(copy, fake_digest(2), artifact_manifest).hit
    manifest.unlink()
    os.mkfifo(manifest)
    give_to_agent(root)

    verdict = in_child(lambda: check_node_copy(copy, fake_digest(2), artifact_manifest))
    assert not verdict.hit and "not a regular file" in verdict.reason
    manifest.unlink()
    elsewhere = root.parent / "poisoned.json"
    elsewhere.write_bytes(canonical)
    manifest.symlink_to(elsewhere)
    verdict = in_child(lambda: check_node_copy(copy, fake_digest(2), artifact_manifest))
    assert not verdict.hit and "Too many levels of symbolic links" in verdict.reason
    manifest.unlink()
    manifest.write_bytes(canonical)
    rank = copy / "model.safetensors"
    rank.unlink()
    os.mkfifo(rank)
    verdict = in_child(lambda: check_node_copy(copy, fake_digest(2), artifact_manifest))
    assert not verdict.hit and "not a regular file" in verdict.reason


def test_the_manifest_reader_refuses_a_fifo_and_a_link(root: Path) -> None:
    tmp_path = root
    os.mkfifo(tmp_path / MANIFEST)
    give_to_agent(root)

    def read() -> str:
        try:
            return repr(read_manifest_bytes(tmp_path))
        except OSError as e:
            return str(e)

    assert "not a regular file" in in_child(read)
    (tmp_path / MANIFEST).unlink()
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / MANIFEST).symlink_to(tmp_path / "real.json")
    with pytest.raises(OSError):
        read_manifest_bytes(tmp_path)


def test_the_plugins_rank_reader_refuses_a_fifo(root: Path) -> None:
    from modelstage.plugin.stores import LocalFiles

    tmp_path = root
    os.mkfifo(tmp_path / "rank.safetensors")
    give_to_agent(root)
    files = LocalFiles([(tmp_path / "rank.safetensors", None)])  # type: ignore[list-item]

    def open_it() -> str:
        try:
            files.open()
        except OSError as e:
            return str(e)
        return "opened"

    assert "not a regular file" in in_child(open_it)


def test_a_2_gib_chunk_is_refused_at_parse_without_allocating(tmp_path: Path) -> None:
    from modelstage.core.manifest import Manifest

    doc = json.loads(copy_manifest(fake_digest(3), b"x" * 10))
    size = 3 * (1 << 31)
    doc["files"]["model.safetensors"] |= {"size": size, "chunkBytes": 1 << 31,
                                          "chunks": ["0" * 64] * 3}  # fmt: skip
    doc["bytes"] = size
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError, match=r"^art/modelstage.json: invalid manifest: "
                           r"files.model.safetensors.chunkBytes: 2147483648 is more than "
                           r"67108864 \(64 MiB\)"):  # fmt: skip
            Manifest.from_json(json.dumps(doc), "art/modelstage.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
