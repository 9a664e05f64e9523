"""The agent's side of the node root: a scan finds complete copies and partial ones and
removes incomplete copies; removal waits for no writer and never removes what one holds the
lock of; nothing but the root's own entries is read or removed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from modelstage.agent import store
from modelstage.agent.locks import digest_lock
from modelstage.core import node_cache
from modelstage.core.manifest import MANIFEST
from support.node_agent import make_copy


def test_scan_finds_copies_and_partials_and_removes_incomplete_copies(tmp_path: Path) -> None:
    root = tmp_path / "root"
    a = make_copy(root, 1, 1000)
    truncated = make_copy(root, 2, 1000)
    directory = node_cache.copy_dir(root, truncated)
    directory.chmod(0o750)
    (directory / "model.safetensors").chmod(0o640)
    (directory / "model.safetensors").write_bytes(b"x" * 10)
    misnamed = make_copy(root, 3, 1000)
    other = "99" * 16
    node_cache.copy_dir(root, misnamed).rename(node_cache.copy_dir(root, other))  # not its name
    partial = make_copy(root, 4, 10, partial=True)
    (root / "other").mkdir()
    (root / "other" / "file").write_text("not ours")
    os.symlink(tmp_path, root / ("cd" * 16))
    scan = store.scan(root)
    assert [c.content for c in scan.copies] == [a]
    manifest = (node_cache.copy_dir(root, a) / MANIFEST).stat().st_size
    assert scan.copies[0].bytes == 1000 + manifest and scan.copies[0].record["content"] == a
    assert [(p.content, p.bytes) for p in scan.partials] == [(partial, 10)]
    assert sorted(r.split(":")[0].split("/")[0] for r in scan.removed) == sorted([truncated, other])
    assert not node_cache.copy_dir(root, truncated).exists()
    assert not node_cache.copy_dir(root, other).exists()
    assert not node_cache.state_file(root, truncated).exists()
    assert (root / "other" / "file").read_text() == "not ours"
    assert (root / ("cd" * 16)).is_symlink() and (tmp_path / "root").is_dir()
    assert scan.problems == [f"{'cd' * 16}: Not a directory; skipped"]  # a link: not opened


def test_nothing_a_writer_holds_the_lock_of_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    a = make_copy(root, 1, 100)
    b = make_copy(root, 2, 100, partial=True)
    c = "77" * 16
    node_cache.copy_dir(root, c).mkdir(parents=True)  # being published: no manifest yet
    with digest_lock(node_cache.lock_file(root, a)), digest_lock(node_cache.lock_file(root, b)), \
         digest_lock(node_cache.lock_file(root, c)):  # fmt: skip
        assert store.remove_copy(root, a) is False
        assert store.remove_partial(root, b) is False
        assert store.partial_locked(root, b)
        scan = store.scan(root)
        assert scan.removed == []
    assert (node_cache.copy_dir(root, a) / MANIFEST).exists()
    assert node_cache.partial_dir(root, b).is_dir()
    assert node_cache.copy_dir(root, c).is_dir()
    assert store.remove_copy(root, a) and store.remove_partial(root, b)
    assert not node_cache.copy_dir(root, a).exists() and not node_cache.partial_dir(root, b).exists()
    assert not node_cache.lock_file(root, a).exists()
    shutil.rmtree(root)
