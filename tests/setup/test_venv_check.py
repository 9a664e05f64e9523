"""``scripts/venv-check``: whether a venv runs this checkout's package, asked of the venv
itself (``scripts/setup`` re-links when it does not; ``tests/conftest.py`` refuses to run).

A venv shared by several checkouts holds one editable link: the checkout that ran setup last,
or one removed since. Each case here is a small venv (no pip) whose ``.pth`` points where such
a link would, checked from this checkout.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "venv-check"


def check(python: str | Path, checkout: Path = ROOT) -> subprocess.CompletedProcess[str]:
    script = checkout / "scripts" / "venv-check"
    return subprocess.run([str(script), str(python)], capture_output=True, text=True, timeout=60)


def venv_linked_to(tmp_path: Path, folder: Path) -> Path:
    """A venv whose only modelstage is a ``.pth`` to ``folder`` (an editable link)."""
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    purelib = sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)})
    Path(purelib, "__editable__.modelstage-0.1.0.pth").write_text(f"{folder}\n")
    return env / "bin" / "python"


def other_checkout(folder: Path) -> Path:
    """A checkout's editable tree: ``modelstage/core`` and ``modelstage/stager``."""
    for part in ("core", "stager"):
        (folder / "modelstage" / part).mkdir(parents=True)
        (folder / "modelstage" / part / "__init__.py").write_text("")
    return folder


def test_the_venv_of_this_checkout_passes() -> None:
    done = check(sys.executable)
    assert done.returncode == 0, done.stderr


def test_a_venv_linked_to_another_checkout_is_named_with_where_it_points(tmp_path: Path) -> None:
    other = other_checkout(tmp_path / "other")
    done = check(venv_linked_to(tmp_path, other))
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"venv-check: modelstage.core comes from {other}/modelstage/core/__init__.py, "
        f"not {ROOT}/: run make setup"
    )


def test_this_venv_seen_from_another_checkout_fails(tmp_path: Path) -> None:
    """The other side of a shared venv: checkout B asks about the venv linked to A."""
    checkout = tmp_path / "b"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "scripts" / "venv-check").write_bytes(CHECK.read_bytes())
    (checkout / "scripts" / "venv-check").chmod(0o755)
    done = check(sys.executable, checkout)
    assert done.returncode == 1
    assert f"comes from {ROOT}/" in done.stderr and f"not {checkout}/" in done.stderr


def test_a_venv_linked_to_a_removed_checkout_fails(tmp_path: Path) -> None:
    gone = other_checkout(tmp_path / "gone")
    python = venv_linked_to(tmp_path, gone)
    for init in gone.glob("modelstage/*/__init__.py"):
        init.unlink()
    for folder in sorted(gone.rglob("*"), reverse=True):
        folder.rmdir()
    gone.rmdir()
    done = check(python)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"venv-check: {python} cannot import modelstage (No module named 'modelstage'): "
        "run make setup"
    )
