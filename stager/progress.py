"""Progress of a long copy: a live line on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

LOG_INTERVAL_S = 10.0
TTY_INTERVAL_S = 0.2


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


class Progress:
    """Thread-safe counters with rate-limited reporting to ``stream`` (stderr by default)."""

    def __init__(
        self, total_bytes: int, total_tensors: int, *, label: str, stream: TextIO | None = None
    ) -> None:
        self.total_bytes, self.total_tensors, self.label = total_bytes, total_tensors, label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.bytes = self.tensors = 0
        self.start = self._last = time.monotonic()
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
        self._maybe_report()

    def tensor_done(self) -> None:
        with self._lock:
            self.tensors += 1
        self._maybe_report()

    def _maybe_report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S):
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        pct = 100.0 * self.bytes / self.total_bytes if self.total_bytes else 100.0
        line = (
            f"{self.label}: {human_bytes(self.bytes)} / {human_bytes(self.total_bytes)} "
            f"({pct:.0f}%), {self.tensors}/{self.total_tensors} tensors, "
            f"{human_bytes(self.bytes / elapsed)}/s"
        )
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        """Final report; on a terminal ends the live line so the next output starts clean."""
        self._maybe_report(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
