"""What every benchmark measures with: repeated timings, a child's wall time and peak RSS,
the page cache dropped, the stager's command line."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Measurement:
    name: str
    seconds: list[float] = field(default_factory=list)
    nbytes: int = 0
    peak_rss: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def throughput(self) -> float:
        return self.nbytes / self.median if self.seconds else 0.0


def drop_page_cache() -> bool:
    """Drop the page cache where permitted (root on a host that allows it)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_child(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a child process.

    The stager reports its own peak (``peakRssBytes`` in its summary line, from VmHWM): the
    kernel's ``ru_maxrss`` of a child also counts this large parent's memory at fork.
    """
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr.strip().splitlines()[-1:]}")
    lines = done.stdout.strip().splitlines()
    try:
        peak = int(json.loads(lines[-1]).get("peakRssBytes", 0)) if lines else 0
    except (ValueError, AttributeError):
        peak = 0
    return seconds, peak


def compile_package() -> None:
    """Write the package's bytecode before a stager child is timed: the stager image has it
    (pip compiles at install), but a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` would
    compile some 40 modules at every start (40 ms of a 2 s staging run here)."""
    import compileall

    import modelstage

    for path in modelstage.__path__:
        compileall.compile_dir(path, quiet=2)


def stager_argv(source: Path, out: Path | str, tp: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "modelstage.stager.cli",
        "stage",
        str(source),
        "--tp",
        str(tp),
        "--out",
        str(out),
        *flags,
    ]
