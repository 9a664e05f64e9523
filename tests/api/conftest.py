"""Fixtures of the API's tests: a valid spec, varied per test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from support.model_specs import BASE_SPEC, merged


@pytest.fixture
def spec_dict() -> Callable[..., dict[str, Any]]:
    def make(**overrides: Any) -> dict[str, Any]:
        return merged(BASE_SPEC, overrides)

    return make
