"""Fails (exit 1) on a product function longer than ``LIMIT`` lines, naming each.

    .venv/bin/python scripts/function_length.py

A function is counted from its ``def`` line to its last line, docstring, comments and blank
lines included: what a reader scrolls through. ruff's PLR0915 counts statements, which a long
call spread over many lines or a long docstring slips past. ``scripts/lint`` runs it over the
source roots (the dev tools included: they are read and changed like the rest).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("core", "api", "operator", "stager", "plugin", "agent", "devtools")
LIMIT = 60
PENDING: frozenset[str] = frozenset()
"""Functions let over the limit for a while (none now); an entry no longer over it fails the
check, so the list only shrinks."""


def long_functions(path: Path, rel: str, limit: int = LIMIT) -> Iterator[tuple[str, int]]:
    """``rel::Qualified.name`` and its length, for each function in ``path`` over ``limit``."""
    yield from _walk(ast.parse(path.read_text(), str(path)), f"{rel}::", limit)


def _walk(node: ast.AST, prefix: str, limit: int) -> Iterator[tuple[str, int]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > limit:
                    yield name, length
            yield from _walk(child, f"{name}.", limit)
        else:
            yield from _walk(child, prefix, limit)


def problems(root: Path = ROOT, roots: Sequence[str] = ROOTS, limit: int = LIMIT) -> list[str]:
    """One line per function over ``limit`` (and per ``PENDING`` entry that no longer is)."""
    found: dict[str, int] = {}
    for top in roots:
        for path in sorted((root / top).rglob("*.py")):
            found.update(long_functions(path, path.relative_to(root).as_posix(), limit))
    lines = [
        f"{name}: {length} lines, the limit is {limit}; split it"
        for name, length in sorted(found.items())
        if name not in PENDING
    ]
    if root == ROOT and tuple(roots) == ROOTS:
        lines += [
            f"{name}: no longer over {limit} lines; remove it from PENDING in "
            "scripts/function_length.py"
            for name in sorted(PENDING - found.keys())
        ]
    return lines


def main() -> int:
    lines = problems()
    for line in lines:
        print(line, file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
