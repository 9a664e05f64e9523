"""Prints which of the README's claimed vLLM cases a CI run proved: each case of the end-to-end
oracle (``tests/vllm/test_vllm_oracle.py``), of the layout oracle (``test_layout_oracle.py``),
of the pipeline-parallel oracles
(``test_layout_oracle_pp.py``, ``test_vllm_pp.py``) and of the older releases
(``tests/vllm/test_vllm_versions.py``) in the JUnit reports given, passed or not, so the log
says what this commit's rotation slot covered. Exit status 0: it only reports."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

CLAIMED = (
    "test_vllm_oracle", "test_layout_oracle", "test_layout_oracle_pp", "test_vllm_pp",
    "test_vllm_versions",
)  # fmt: skip


def outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return tag
    return "passed"


def main(reports: list[str]) -> None:
    rows = []
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").rsplit(".", 1)[-1]
            if module in CLAIMED:
                rows.append((module, case.get("name", ""), outcome(case)))
    passed = sum(r[2] == "passed" for r in rows)
    print(f"ci: claimed vLLM cases run: {passed} passed of {len(rows)}")
    for module, name, result in sorted(rows):
        print(f"ci:   {result:<7} {module}::{name}")


if __name__ == "__main__":
    main(sys.argv[1:])
