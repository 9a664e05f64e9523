"""The node root's files: the per-content lock and the directories the agent owns.

Writers of one content meet on ``.partial/<content>.lock`` (``flock``): a file being received
holds it shared (several files of one copy arrive at once), a commit, a removal or a
re-verification holds it exclusive; the agent's pass takes it without waiting before it
removes anything, so it never deletes what is being written or committed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path


def own_dir(path: Path) -> Path:
    """``path`` as a real directory: created when missing; a link there (which could point
    out of the root) or a file is removed first, never followed."""
    try:
        found = os.lstat(path).st_mode
    except FileNotFoundError:
        found = stat.S_IFDIR
    if not stat.S_ISDIR(found):
        # another thread may have replaced it with the directory meanwhile: that is the goal
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            path.unlink()
    path.mkdir(exist_ok=True)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(errno.ENOTDIR, "not a directory", str(path))
    return path


def _open_locked(path: Path, *, wait: bool, shared: bool = False) -> int | None:
    """An fd holding ``flock`` on ``path`` (created if missing), or None when another process
    holds it and ``wait`` is False. Re-opened when the file was unlinked and replaced while we
    waited (the holder cleaned it up), so two processes never each hold "the" lock."""
    while True:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(path, flags, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        try:
            kind = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            fcntl.flock(fd, kind | (0 if wait else fcntl.LOCK_NB))
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            os.close(fd)
            continue
        held = os.fstat(fd)
        if (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


@contextlib.contextmanager
def digest_lock(path: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold the content's lock, waiting for an exclusive holder to finish (``shared``: with
    other shared holders)."""
    fd = _open_locked(path, wait=True, shared=shared)
    assert fd is not None
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_digest_lock(path: Path, *, unlink: bool = False) -> Iterator[bool]:
    """Take the copy lock if nobody holds it (True), else yield False at once. ``unlink``:
    remove the lock file while still holding it (the agent cleaning a digest up)."""
    fd = _open_locked(path, wait=False)
    if fd is None:
        yield False
        return
    try:
        yield True
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)


def is_locked(path: Path) -> bool:
    """Whether a copier holds the lock now (a missing lock file: nobody)."""
    if not path.exists():
        return False
    with try_digest_lock(path) as free:
        return not free
