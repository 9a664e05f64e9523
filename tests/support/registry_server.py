"""A real OCI registry for tests: Debian's ``docker-registry`` (CNCF distribution 2.8) on
127.0.0.1, with its storage in a temporary directory, optionally with TLS and basic auth.

Its log records every request (``http.request.method``, ``http.request.uri``), which the
tests count: a push that uploads nothing makes no ``POST .../blobs/uploads/``.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

BINARY = "docker-registry"
READY_TIMEOUT_S = 30.0


def missing_tools(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


def require(*tools: str) -> None:
    """Skip the test, naming what is absent, when one of ``tools`` is not installed."""
    import pytest

    absent = missing_tools(*tools)
    if absent:
        pytest.skip(f"{', '.join(absent)} not installed (scripts/setup installs them with apt)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Registry:
    host: str
    """``127.0.0.1:PORT``."""
    root: Path
    """The storage directory (``docker/registry/v2/...``)."""
    log: Path
    process: subprocess.Popen[bytes]
    ca_file: Path | None = None
    auth_file: Path | None = None
    password: str = ""

    def requests(self, method: str, path_part: str = "") -> int:
        """How many requests of ``method`` (whose URI contains ``path_part``) it answered."""
        text = self.log.read_text(errors="replace")
        pattern = re.compile(r'http\.request\.method=(\w+).*?http\.request\.uri="?([^" ]+)')
        return sum(
            1
            for line in text.splitlines()
            if "response completed" in line
            for m in [pattern.search(line)]
            if m and m.group(1) == method and path_part in m.group(2)
        )

    def uploads(self) -> int:
        return self.requests("POST", "/blobs/uploads/")

    def blob_path(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


def write_config(root: Path, port: int, log_level: str = "info", tls: tuple[Path, Path] | None = None,
                 htpasswd: Path | None = None, auth: dict[str, object] | None = None) -> Path:  # fmt: skip
    config: dict[str, object] = {
        "version": 0.1,
        "log": {"level": log_level, "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(root / "data")},
            "delete": {"enabled": True},
        },
        "http": {"addr": f"127.0.0.1:{port}", "secret": "modelstage-test-only"},
    }
    if tls is not None:
        config["http"] = {**config["http"], "tls": {"certificate": str(tls[0]), "key": str(tls[1])}}  # type: ignore[dict-item]
    if htpasswd is not None:
        config["auth"] = {"htpasswd": {"realm": "modelstage-test", "path": str(htpasswd)}}
    if auth is not None:
        config["auth"] = auth
    path = root / "config.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def run_registry(root: Path, *, tls: tuple[Path, Path] | None = None, htpasswd: Path | None = None,
                 ca_file: Path | None = None, auth_file: Path | None = None,
                 auth: dict[str, object] | None = None) -> Iterator[Registry]:  # fmt: skip
    """Start the registry, wait until it answers, stop it afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = write_config(root, port, tls=tls, htpasswd=htpasswd, auth=auth)
    log = root / "registry.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([BINARY, "serve", str(config)], stdout=out, stderr=out)
    registry = Registry(f"127.0.0.1:{port}", root / "data", log, process, ca_file, auth_file)
    try:
        _wait_ready(registry, tls is not None)
        yield registry
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _wait_ready(registry: Registry, tls: bool) -> None:
    scheme = "https" if tls else "http"
    context = (
        ssl.create_default_context(cafile=str(registry.ca_file))
        if tls and registry.ca_file
        else None
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if registry.process.poll() is not None:
            raise RuntimeError(f"docker-registry exited: {registry.log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{scheme}://{registry.host}/v2/", timeout=2, context=context)
            return
        except urllib.error.HTTPError:
            return  # 401: up, and asking for credentials
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"docker-registry did not answer: {registry.log.read_text()[-2000:]}")


def docker_config(path: Path, host: str, user: str, password: str) -> Path:
    """A docker config JSON file with credentials for ``host``."""
    import base64

    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path
