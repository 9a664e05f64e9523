"""The import contracts are allow-lists: every package of every source root is a root package
of ``.importlinter``, and every one but the operator is a source of the contract that forbids
the operator, so a new package cannot import the operator without this test failing first."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _config() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    return config


def _listed(section: configparser.SectionProxy, key: str) -> set[str]:
    return {line.strip() for line in section[key].splitlines() if line.strip()}


def packages_on_disk() -> set[str]:
    """``modelstage.<name>`` for each ``<root>/modelstage/<name>/__init__.py`` of the checkout."""
    return {f"modelstage.{init.parent.name}" for init in ROOT.glob("*/modelstage/*/__init__.py")}


def test_every_package_of_the_checkout_is_a_root_package() -> None:
    roots = _listed(_config()["importlinter"], "root_packages")
    assert packages_on_disk() == roots


def test_every_package_but_the_operator_is_forbidden_the_operator() -> None:
    config = _config()
    contract = config["importlinter:contract:operator-private"]
    assert contract["forbidden_modules"].strip() == "modelstage.operator"
    sources = _listed(contract, "source_modules")
    assert sources == _listed(config["importlinter"], "root_packages") - {"modelstage.operator"}


def test_no_import_of_the_operator_is_let_through() -> None:
    """The offline ``plan`` reaches the operator's planner through its entry point, not an
    import: the contract ignores nothing."""
    assert "ignore_imports" not in _config()["importlinter:contract:operator-private"]


def test_the_operators_offline_planner_is_published_where_plan_looks_it_up() -> None:
    from importlib.metadata import entry_points

    from modelstage.operator.offline_report import deployment_report
    from modelstage.stager.plan import PLANNERS

    (found,) = entry_points(group=PLANNERS, name="deployment")
    assert found.load() is deployment_report
