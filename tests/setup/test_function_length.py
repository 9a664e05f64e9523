"""``scripts/function_length.py``: the 60-line limit on product functions, which
``scripts/lint`` enforces. Each case writes a scratch source root and checks what the script
says of it; the last one holds the repository itself to the limit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "function_length.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("function_length", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines - 1))
    return f"{indent}def {name}() -> None:\n{body}{indent}    return None\n"


def test_a_function_over_the_limit_is_named_with_its_length(tmp_path: Path) -> None:
    src = tmp_path / "core" / "modelstage" / "core"
    src.mkdir(parents=True)
    (src / "long.py").write_text(_function("short", 59) + "\n\n" + _function("long", 61))
    assert _script().problems(tmp_path, ("core",)) == [
        "core/modelstage/core/long.py::long: 62 lines, the limit is 60; split it"
    ]


def test_a_method_and_a_nested_function_count_by_their_own_lines(tmp_path: Path) -> None:
    src = tmp_path / "agent"
    src.mkdir()
    nested = "def outer() -> None:\n" + _function("inner", 60, "    ")
    method = "class Store:\n" + _function("scan", 61, "    ")
    (src / "m.py").write_text(nested + "\n\n" + method)
    found = _script().problems(tmp_path, ("agent",))
    assert found == [
        "agent/m.py::Store.scan: 62 lines, the limit is 60; split it",
        "agent/m.py::outer: 62 lines, the limit is 60; split it",
        "agent/m.py::outer.inner: 61 lines, the limit is 60; split it",
    ]


def test_exactly_the_limit_passes(tmp_path: Path) -> None:
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "m.py").write_text(_function("fits", 59))
    assert _script().problems(tmp_path, ("api",)) == []


def test_every_product_function_is_within_the_limit() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
