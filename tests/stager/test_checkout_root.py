"""The checkout root is safe on ``sys.path``: its folders are source roots, not packages, so
Python (and vLLM, whose workers import ``operator``) runs from it as from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_at_root(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip


def test_the_standard_librarys_operator_is_imported_from_the_checkout_root() -> None:
    done = run_at_root(
        "-c",
        "import operator, sys; operator.eq; import modelstage.api.modeldeployment; "
        "print(operator.__file__)",
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent != ROOT / "operator"


@pytest.mark.vllm
def test_vllm_runs_from_the_checkout_root() -> None:
    done = run_at_root("-m", "vllm.entrypoints.openai.api_server", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--load-format" in done.stdout


def test_no_top_folder_is_a_package_and_each_source_root_holds_only_its_package() -> None:
    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["where"]
    assert not [p for p in ROOT.iterdir() if (p / "__init__.py").exists()]
    for root in roots:
        found = {p.name for p in (ROOT / root).iterdir() if p.name != "__pycache__"}
        assert found == {"modelstage"}, (root, found)
        assert not (ROOT / root / "modelstage" / "__init__.py").exists(), "a namespace package"
        # A folder left holding only bytecode (a package moved away) is no package.
        packages = {p.name for p in (ROOT / root / "modelstage").iterdir()
                    if p.is_dir() and any(c.name != "__pycache__" for c in p.iterdir())}  # fmt: skip
        assert packages - {"__pycache__"} == {root}, (root, packages)
