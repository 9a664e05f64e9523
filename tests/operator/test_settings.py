"""The operator's settings: what reaches the API server in a URL has the API server's type."""

from __future__ import annotations

import re

import kopf
import pytest
from hypothesis import given
from hypothesis import strategies as st
from modelstage.operator.settings import OperatorConfig, configure, match_namespace


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


NAMESPACE_PATTERNS = ["team-a", "team-*", "!team-b", "team-*, !team-b", "!*-pr-*, *pr-123",
                      "myapp-*, !*-pr-*, *pr-123", "*", " a , b "]  # fmt: skip


@given(name=st.sampled_from(["team-a", "team-b", "team-c", "myapp-pr-123", "myapp-pr-456",
                             "otherapp-pr-123", "a", "b", "c"]) | st.text("ab-*!", max_size=6),
       pattern=st.sampled_from(NAMESPACE_PATTERNS) | st.text("ab-*!, ", max_size=8))  # fmt: skip
def test_namespace_patterns_match_as_kopf_matches_them(name: str, pattern: str) -> None:
    from kopf._cogs.structs.references import match_namespace as kopfs

    assert match_namespace(name, pattern) == kopfs(name, pattern)


def test_an_operator_serves_the_namespaces_of_its_patterns_or_every_one() -> None:
    assert OperatorConfig().watches("anything")
    scoped = OperatorConfig(watched_namespaces=("team-a", "ml-*"))
    assert scoped.watches("team-a") and scoped.watches("ml-x")
    assert not scoped.watches("team-b") and not scoped.watches("")
