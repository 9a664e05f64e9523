"""One vLLM at a time on this machine, whichever suite or session starts it.

vLLM on 2 cores is slow enough alone; two at once time out. The lock is a ``flock`` on a
well-known file, re-entrant within a process (a fixture may hold it around a helper that
takes it again: ``flock`` on a second descriptor of the same file would deadlock).
"""

from __future__ import annotations

import fcntl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

VLLM_LOCK = "/tmp/modelstage-vllm.lock"
_guard = threading.RLock()
_held: list[IO[str]] = []


@contextmanager
def vllm_lock() -> Iterator[float]:
    """Hold the machine-wide vLLM lock; yields the seconds spent waiting for it."""
    started = time.monotonic()
    with _guard:
        outermost = not _held
        if outermost:
            f = open(VLLM_LOCK, "a")  # noqa: SIM115 - closed in the finally below
            fcntl.flock(f, fcntl.LOCK_EX)
            _held.append(f)
        try:
            yield time.monotonic() - started
        finally:
            if outermost:
                f = _held.pop()
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
