"""Fixtures every tier shares: one real S3 server (SeaweedFS on 127.0.0.1) per test session,
with distinctive credentials that tests grep every output for, and a fresh bucket per test."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.s3_server import ACCESS_KEY, SECRET_KEY, S3Server, s3_server

_buckets = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    """Never test another checkout's code: a shared venv's editable link is the last setup's
    (scripts/venv-check says where it points)."""
    check = Path(__file__).resolve().parents[1] / "scripts" / "venv-check"
    done = subprocess.run([str(check), sys.executable], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.exit(done.stderr.strip(), returncode=4)


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
