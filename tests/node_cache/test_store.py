"""The agent's side of the node root: a scan finds complete copies and partial ones and
removes broken copies; removal waits for no copier and never removes what one holds the lock
of; nothing but the root's own entries is read or removed."""

from __future__ import annotations

import os
from pathlib import Path

from modelstage.agent import store
from modelstage.agent.locks import digest_lock
from modelstage.core import node_cache
from modelstage.core.manifest import MANIFEST
from support.node_agent import fake_digest, make_copy

A, B, C, D = (fake_digest(i) for i in range(1, 5))


def test_scan_finds_copies_and_partials_and_removes_broken_copies(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make_copy(root, A, 1000)
    truncated = make_copy(root, B, 1000)
    (truncated / "model.safetensors").write_bytes(b"x" * 10)
    misnamed = make_copy(root, C, 1000)
    misnamed.rename(node_cache.copy_dir(root, D))  # holds C's manifest under D's name
    make_copy(root, "ab" * 10, 10, partial=True)
    (root / "other").mkdir()
    (root / "other" / "file").write_text("not ours")
    os.symlink(tmp_path, root / ("cd" * 10))
    scan = store.scan(root)
    assert [c.digest for c in scan.copies] == [A]
    assert scan.copies[0].bytes == 1000 and scan.copies[0].record["digest"] == A
    assert [(p.digest, p.bytes, p.locked) for p in scan.partials] == [("ab" * 10, 10, False)]
    assert sorted(r.split(":")[0] for r in scan.removed) == [B, D]
    assert not node_cache.copy_dir(root, B).exists() and not node_cache.copy_dir(root, D).exists()
    assert not node_cache.state_file(root, B).exists()
    assert (root / "other" / "file").read_text() == "not ours"
    assert (root / ("cd" * 10)).is_symlink() and (tmp_path / "root").is_dir()


def test_nothing_a_copier_holds_the_lock_of_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make_copy(root, A, 100)
    make_copy(root, B, 100, partial=True)
    (node_cache.copy_dir(root, C)).mkdir(parents=True)  # a copy being replaced: no manifest yet
    with digest_lock(node_cache.lock_file(root, A)), digest_lock(node_cache.lock_file(root, B)), \
         digest_lock(node_cache.lock_file(root, C)):  # fmt: skip
        assert store.remove_copy(root, A) is False
        assert store.remove_partial(root, B) is False
        scan = store.scan(root)
        assert [p.locked for p in scan.partials] == [True]
        assert scan.removed == []
    assert (node_cache.copy_dir(root, A) / MANIFEST).exists()
    assert node_cache.partial_dir(root, B).is_dir()
    assert node_cache.copy_dir(root, C).is_dir()
    assert store.remove_copy(root, A) and store.remove_partial(root, B)
    assert not node_cache.copy_dir(root, A).exists() and not node_cache.partial_dir(root, B).exists()
    assert not node_cache.lock_file(root, A).exists()
