"""Generated docs are fresh, and the shell scripts for people and CI parse and pass shellcheck."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from support.charts import ROOT, run, tool

SHELL_SCRIPTS = ("e2e/kind.sh", "scripts/tools", "scripts/setup", "scripts/test", "scripts/lint",
                 "scripts/bench-s3", ".ci/run")  # fmt: skip


def _crd_reference() -> str:
    spec = importlib.util.spec_from_file_location(
        "crd_reference", ROOT / "scripts" / "crd_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.render()
    return text


def test_crd_reference_is_not_stale() -> None:
    assert (ROOT / "docs" / "crd-reference.md").read_text() == _crd_reference(), (
        "docs/crd-reference.md is stale: run "
        "`.venv/bin/python scripts/crd_reference.py > docs/crd-reference.md`"
    )


def test_crd_reference_lists_every_spec_field() -> None:
    text = _crd_reference()
    for field in ("spec.model.uri", "spec.parallelism.tensor", "spec.storage.s3.caBundleSecret",
                  "spec.serving.targetRef.name", "status.artifact.digest"):  # fmt: skip
        assert f"`{field}`" in text


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse_and_pass_shellcheck(script: str) -> None:
    path = str(ROOT / script)
    run(["bash", "-n", path])
    result = run([tool("shellcheck"), "--severity=style", path], check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_docs_name_the_crd_upgrade_path() -> None:
    upgrade = "kubectl apply --server-side -f charts/modelstage/crds/"
    for doc in ("README.md", "docs/install.md", "docs/troubleshooting.md", "e2e/README.md"):
        assert upgrade in (ROOT / doc).read_text(), f"{doc} does not give the CRD upgrade path"
    assert upgrade in Path(ROOT / "e2e" / "kind.sh").read_text()


def test_install_doc_table_matches_the_chart_rules() -> None:
    """Every resource the chart grants appears in docs/install.md's RBAC table."""
    from support.charts import of_kind, render

    text = (ROOT / "docs" / "install.md").read_text()
    for scenario in ("default", "namespaced", "node-cache"):
        for role in of_kind(render(scenario), "ClusterRole") + of_kind(render(scenario), "Role"):
            for rule in role["rules"]:
                for resource in rule["resources"]:
                    assert f"`{resource}`" in text, f"docs/install.md does not justify {resource}"
