"""A real OCI registry (Debian's docker-registry, CNCF distribution 2.8) on 127.0.0.1 per test,
and skopeo and umoci to pull and unpack what was pushed as a runtime would. Installed by
scripts/setup; a test skips, saying which binary is absent, only when one is."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from support.registry_server import Registry, docker_config, require, run_registry

TOOLS = ("docker-registry", "skopeo", "umoci")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    require(*TOOLS)
    with run_registry(tmp_path / "registry") as server:
        yield server


@pytest.fixture
def secure_registry(tmp_path: Path) -> Iterator[Registry]:
    """TLS (a self-signed certificate for 127.0.0.1) and basic auth: the registry provisions
    its htpasswd file with a random password for user ``docker`` and logs it once."""
    require(*TOOLS, "openssl")
    tls = tmp_path / "tls"
    tls.mkdir()
    cert, key = tls / "cert.pem", tls / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    root = tmp_path / "registry"
    with run_registry(root, tls=(cert, key), htpasswd=tmp_path / "htpasswd", ca_file=cert) as reg:
        found = re.search(r"password=(\S+) user=docker", reg.log.read_text())
        assert found, "the registry did not provision its htpasswd file"
        reg.password = found.group(1)
        reg.auth_file = docker_config(tmp_path / "auth.json", reg.host, "docker", reg.password)
        yield reg


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint in two source files, q/k/v and gate/up spread across them."""
    spec = SyntheticModel(num_shards=2, split_fused=True)
    return write_checkpoint(spec, tmp_path_factory.mktemp("oci") / "ckpt")


@pytest.fixture(scope="session")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~65 MB of float32 weights: several 16 MiB PATCHes per rank file."""
    spec = SyntheticModel(hidden_size=512, intermediate_size=2048, num_layers=2,
                          vocab_size=8000, num_shards=2)  # fmt: skip
    return write_checkpoint(spec, tmp_path_factory.mktemp("ocibig") / "ckpt")
