"""Progress of a long copy, download or hash: a live line on a terminal, periodic log lines
otherwise, each with bytes done of the total, the rate and an ETA."""

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


def human_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: short enough for a log line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Thread-safe counters with rate-limited reporting to ``stream`` (stderr by default).

    ``items`` names what ``total_tensors`` counts (tensors, files, parts). A total that
    becomes known while the work runs (a download whose size arrives with its response)
    grows with ``add_total``.
    """

    def __init__(
        self,
        total_bytes: int,
        total_tensors: int,
        *,
        label: str,
        stream: TextIO | None = None,
        items: str = "tensors",
    ) -> None:
        self.total_bytes, self.total_tensors, self.label = total_bytes, total_tensors, label
        self.items = items
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.bytes = self.tensors = 0
        self.start = self._last = time.monotonic()
        self._lock = threading.Lock()

    def add_total(self, nbytes: int, items: int = 0) -> None:
        with self._lock:
            self.total_bytes += nbytes
            self.total_tensors += items

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
        self._maybe_report()

    def tensor_done(self) -> None:
        with self._lock:
            self.tensors += 1
        self._maybe_report()

    def line(self, now: float | None = None, *, final: bool = False) -> str:
        """The current report: done / total (percent), items, rate, and the ETA (or, once
        done or ``final``, the time taken)."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        done, total = self.bytes, self.total_bytes
        pct = 100.0 * done / total if total else 100.0
        rate = done / elapsed
        text = (
            f"{self.label}: {human_bytes(done)} / {human_bytes(total)} ({pct:.0f}%), "
            f"{self.tensors}/{self.total_tensors} {self.items}, {human_bytes(rate)}/s"
        )
        if done < total and not final:
            eta = human_duration((total - done) / rate) if done else "unknown"
            text += f", ETA {eta}"
        else:
            text += f", {human_duration(elapsed)}"
        return text

    def _maybe_report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S):
            return
        self._last = now
        line = self.line(now, final=force)
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
