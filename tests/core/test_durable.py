"""``core.durable``: the writes every writer (stager, engine capture, node agent) relies on."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from modelstage.core.durable import write_atomic


def test_write_atomic_leaves_another_writers_temporary_file_alone(tmp_path: Path) -> None:
    """Two agents on one node (a DaemonSet's rolling update) are both likely PID 1 in their
    containers: a temporary name from the PID would be the same for both."""
    path = tmp_path / "record.json"
    theirs = tmp_path / f".record.json.{os.getpid()}.tmp"
    theirs.write_bytes(b'{"half": ')
    write_atomic(path, b'{"whole": 1}')
    assert json.loads(path.read_bytes()) == {"whole": 1}
    assert theirs.read_bytes() == b'{"half": '
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, path.name]


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "record.json"
    write_atomic(path, b"old", 0o644)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
