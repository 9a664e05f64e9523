"""Fixtures of the chart and packaging checks; the helpers live in ``support.charts``."""

from __future__ import annotations

from typing import Any

import pytest
from support.charts import SCENARIOS, render


@pytest.fixture(params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def rendered(scenario: str) -> list[dict[str, Any]]:
    return render(scenario)
