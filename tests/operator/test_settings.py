"""The operator's settings: what reaches the API server in a URL has the API server's type."""

from __future__ import annotations

import re

import kopf
import pytest
from modelstage.operator.settings import OperatorConfig, configure


def test_the_watch_timeout_reaches_kopf_as_an_integer() -> None:
    """kopf sends ``str(server_timeout)`` as ``timeoutSeconds``, which the API server parses
    with ``strconv.ParseInt``: ``300.0`` is a 400 and the operator's watches all fail."""
    for env in ({}, {"MODELSTAGE_OPERATOR_WATCH_SERVER_TIMEOUT": "20"}):
        settings = kopf.OperatorSettings()
        configure(settings, OperatorConfig.from_env(env))
        assert str(settings.watching.server_timeout).isdigit()


def test_a_fractional_watch_timeout_is_refused_with_its_name() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape("MODELSTAGE_OPERATOR_WATCH_SERVER_TIMEOUT='2.5' is not a whole number"),
    ):
        OperatorConfig.from_env({"MODELSTAGE_OPERATOR_WATCH_SERVER_TIMEOUT": "2.5"})
