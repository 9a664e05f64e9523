"""Run a process in small time slices and SIGKILL it once it has written a given number of
bytes: a deterministic-enough kill point with no hook in the code under test.

The child is stopped (SIGSTOP) between slices, so the progress read when the decision is
made is the progress made when it dies. The default measure is ``wchar`` in
``/proc/<pid>/io``: bytes passed to write(2)-like calls on files (a local destination).
Uploads go through send(2), which ``wchar`` does not count: measure them where they arrive
(``FaultProxy.bytes_up``). The kill lands at most one slice (a few milliseconds of work)
after the threshold, and never after the process finished on its own unnoticed: if the
harness itself was descheduled long enough for the run to finish first, ``Kill.written`` is
-1 and the caller tries that kill point again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SLICE_S = 0.003
STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class Kill:
    threshold: int
    written: int
    """Bytes the process had written (wchar) when it was killed; -1 if it finished first."""
    returncode: int
    log: str


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "X"
    return stat.rsplit(")", 1)[1].split()[0]


def wchar(pid: int) -> int:
    """Bytes the process passed to write(2)-like calls on files (not to send(2) on sockets:
    for uploads count at the server side, e.g. FaultProxy.bytes_up)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/io has no wchar")


def _stop(proc: subprocess.Popen[bytes]) -> bool:
    """Stop the child and wait until it is stopped; False if it has exited meanwhile."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        state = _state(proc.pid)
        if state in ("T", "t"):
            return True
        if state in ("Z", "X") or proc.poll() is not None:
            return False
        time.sleep(0.0002)
    raise AssertionError(f"pid {proc.pid} did not stop within {STOP_WAIT_S} s")


def kill_after_writing(
    cmd: list[str],
    threshold: int,
    *,
    env: dict[str, str],
    log: Path,
    progress: Callable[[int], int] = wchar,
    timeout_s: float = 120.0,
) -> Kill:
    """Start ``cmd`` and SIGKILL it at the first slice boundary where ``progress(pid)`` (by
    default the bytes it wrote) is at least ``threshold`` (0: during start-up)."""
    with open(log, "wb") as out:
        # niced, so that on a busy machine the harness wakes up on time between slices
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/",
                                preexec_fn=lambda: os.nice(5))  # fmt: skip
    deadline = time.monotonic() + timeout_s
    written = -1
    try:
        while time.monotonic() < deadline:
            time.sleep(SLICE_S)
            if not _stop(proc):
                break
            current = progress(proc.pid)
            if current >= threshold:
                written = current
                os.kill(proc.pid, signal.SIGKILL)
                break
            os.kill(proc.pid, signal.SIGCONT)
        else:
            raise AssertionError(f"{cmd[:3]} neither finished nor reached {threshold} bytes")
    finally:
        if proc.poll() is None and written < 0:
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.wait(timeout=30)
    return Kill(threshold, written, proc.returncode, log.read_text(errors="replace"))
