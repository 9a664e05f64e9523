"""This node's hardware class (``core/engine_key.HardwareClass``), measured where it runs.

A GPU when ``nvidia-smi`` answers with one (name and compute capability of the first device:
a serving pod's GPUs are of one type), else the CPU from ``/proc/cpuinfo``. An initContainer
without a GPU allocated sees no device: ``prepare`` then takes the class it is told
(``--engine-hardware``), which the operator reads from the node's labels.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

from modelstage.core.engine_key import HardwareClass, cpu_class, gpu_class

CPUINFO = Path("/proc/cpuinfo")


def this_node(cpuinfo: Path = CPUINFO) -> HardwareClass:
    gpu = _first_gpu()
    if gpu is not None:
        return gpu
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    return cpu_class(text, platform.machine())


def _first_gpu() -> HardwareClass | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[:1]
    if not first or "," not in first[0]:
        return None
    name, capability = first[0].rsplit(",", 1)
    return gpu_class(name, capability)
