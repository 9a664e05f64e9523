"""Writes that survive a crash: a file or a directory fsynced, a small file replaced whole.

A rename is durable only once its directory is fsynced, and a file's bytes only once the file
is; every writer of artifacts, engine caches and node-cache records uses these, so "written"
means the same everywhere.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (names created, renamed, removed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make the bytes of file ``path``, written through another descriptor, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """``path`` holds ``data`` or what it held before, never a part (tmp, fsync, rename,
    directory fsync). The temporary name is random and created exclusively: two writers of
    the same file (the copy Job and the agent, each likely PID 1 in its container) never share
    one, and a link planted there is never followed. A failed write (a full disk) leaves no
    temporary file."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, mode)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
