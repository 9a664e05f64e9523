"""Fixtures every tier shares: one real S3 server (SeaweedFS on 127.0.0.1) per test session,
with distinctive credentials that tests grep every output for, and a fresh bucket per test."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
from support.s3_server import ACCESS_KEY, SECRET_KEY, S3Server, s3_server

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(
        tmp_path_factory.mktemp("s3"), access_key=ACCESS_KEY, secret_key=SECRET_KEY
    ) as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server, request: pytest.FixtureRequest) -> str:
    """A new bucket named after the test's folder (``s3-…``, ``sources-…``)."""
    name = f"{request.path.parent.name}-{os.getpid()}-{next(_buckets)}".replace("_", "-")
    s3.create_bucket(name)
    return name
