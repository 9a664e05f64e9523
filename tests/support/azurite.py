"""A real Azure Blob endpoint for tests: Azurite (npm ``azurite``, ``scripts/azurite``) on
127.0.0.1, with a fresh workspace folder, an account of its own and a debug log.

The account key is distinctive so that tests can grep every output for it. The debug log
records each request Azurite serves (``Put Block``, ``Put Blob``, ...), which is how tests
count uploads. Azurite 3.37 may predate the SDK's newest API version, so the version check
is skipped.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelstage.core.azure_client import AzureOptions

from .s3_server import free_ports

ACCOUNT = "msteststore"
KEY = base64.b64encode(b"ms-test-azure-key/Okapi+Narwhal+Axolotl+0451!").decode()
"""The emulator account's key: long and distinctive, so tests can grep for it."""
VERSION = "3.37.0"
READY_TIMEOUT_S = 60.0


def azurite_binary() -> str | None:
    """``azurite-blob`` as ``scripts/azurite`` installs it, else on PATH; None: not installed."""
    tools = Path(os.environ.get("MODELSTAGE_TOOLS", Path.home() / ".cache/modelstage/tools"))
    found = tools / f"azurite-{VERSION}" / "node_modules" / ".bin" / "azurite-blob"
    if found.exists():
        return str(found)
    return shutil.which("azurite-blob")


def require_azurite() -> None:
    """Skip, saying why, where Azurite could not be installed."""
    if azurite_binary() is None:
        import pytest

        pytest.skip("Azurite is not installed: run scripts/azurite (needs node and npm)")


@dataclass
class Azurite:
    workdir: Path
    port: int
    process: subprocess.Popen[bytes]
    debug_log: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def env(self) -> dict[str, str]:
        """What the stager and Run:ai's Azure backend read to reach this account."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def options(self, **kw: Any) -> AzureOptions:
        return AzureOptions.from_env(self.env(), **kw)

    def container(self, name: str) -> Any:
        """A plain SDK client for checks that must not go through the code under test."""
        from azure.storage.blob import ContainerClient

        client = ContainerClient.from_connection_string(self.connection_string, name)
        with contextlib.suppress(Exception):
            client.create_container()
        return client

    def requests(self, operation: str) -> int:
        """How many requests of ``operation`` (e.g. ``PutBlock``) Azurite has served."""
        text = self.debug_log.read_text(errors="replace") if self.debug_log.exists() else ""
        pattern = rf"Operation=(?:BlockBlob_|Blob_)?{operation}\b"
        return len(re.findall(pattern, text))

    def kill(self) -> None:
        """SIGKILL, as a crashed or evicted server goes."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=15)

    def start(self) -> None:
        """(Re)start on the same port and workspace: what was committed before is still there."""
        binary = azurite_binary()
        assert binary is not None
        args = [
            binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--location", str(self.workdir / "data"), "--debug", str(self.debug_log),
            "--silent", "--skipApiVersionCheck", "--disableTelemetry", "--loose",
        ]  # fmt: skip
        env = {**os.environ, "AZURITE_ACCOUNTS": f"{ACCOUNT}:{KEY}"}
        with open(self.workdir / "azurite.out", "ab") as out:
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir, env=env,
                start_new_session=True,
            )  # fmt: skip
        _wait_ready(self)


@contextlib.contextmanager
def azurite(workdir: Path) -> Iterator[Azurite]:
    """Start Azurite's blob service in ``workdir``, wait until it answers, stop it on exit."""
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    server = Azurite(workdir, free_ports(1)[0], None, workdir / "debug.log")  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        _stop(server.process)


def _wait_ready(server: Azurite) -> None:
    from azure.storage.blob import BlobServiceClient

    deadline = time.monotonic() + READY_TIMEOUT_S
    last: Exception | None = None
    client = BlobServiceClient.from_connection_string(server.connection_string)
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            out = (server.workdir / "azurite.out").read_text(errors="replace")
            raise RuntimeError(f"azurite exited: {out[-2000:]}")
        try:
            list(client.list_containers())
            return
        except Exception as e:
            last = e
            time.sleep(0.3)
    raise RuntimeError(f"azurite not ready after {READY_TIMEOUT_S} s: {last}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=15)
