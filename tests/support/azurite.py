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
import sys
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
    cert: Path | None = None
    """With TLS: the self-signed certificate (``127.0.0.1`` and ``*.blob.localhost``)."""

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.cert else "http"
        return f"{scheme}://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol={'https' if self.cert else 'http'};"
            f"AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def env(self) -> dict[str, str]:
        """What the stager and Run:ai's Azure listing read to reach this account."""
        env = {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}
        if self.cert:
            env["REQUESTS_CA_BUNDLE"] = str(self.cert)  # the Python SDK's trust (requests)
        return env

    def runai_env(self) -> dict[str, str]:
        """What Run:ai's C++ Azure backend reads as well: it takes no connection string and
        addresses ``https://ACCOUNT.SUFFIX`` only, so the suffix is ``blob.localhost:PORT``
        (curl resolves ``*.localhost`` to loopback itself; Azurite reads the account from the
        host name). Its curl trusts only the system CA bundle (``vllm_python``)."""
        assert self.cert, "Run:ai's Azure backend speaks HTTPS only: start Azurite with tls"
        return {
            **self.env(),
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": KEY,
            "AZURE_STORAGE_ENDPOINT_SUFFIX": f"blob.localhost:{self.port}",
        }

    def options(self, **kw: Any) -> AzureOptions:
        if self.cert:
            kw.setdefault("ca_bundle", str(self.cert))
        return AzureOptions.from_env(self.env(), **kw)

    def container(self, name: str) -> Any:
        """A plain SDK client for checks that must not go through the code under test."""
        from azure.storage.blob import ContainerClient

        client = ContainerClient.from_connection_string(
            self.connection_string, name, connection_verify=str(self.cert) if self.cert else True
        )
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
        if self.cert:
            args += ["--cert", str(self.cert), "--key", str(self.cert.with_suffix(".key"))]
        env = {**os.environ, "AZURITE_ACCOUNTS": f"{ACCOUNT}:{KEY}"}
        with open(self.workdir / "azurite.out", "ab") as out:
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir, env=env,
                start_new_session=True,
            )  # fmt: skip
        _wait_ready(self)


def make_certificate(workdir: Path) -> Path:
    """A self-signed certificate for ``127.0.0.1`` and ``*.blob.localhost`` (``openssl``)."""
    cert, key = workdir / "azurite.pem", workdir / "azurite.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={ACCOUNT}.blob.localhost",
         "-addext", f"subjectAltName=DNS:{ACCOUNT}.blob.localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert


@contextlib.contextmanager
def azurite(workdir: Path, *, tls: bool = False) -> Iterator[Azurite]:
    """Start Azurite's blob service in ``workdir`` (``tls``: HTTPS with a certificate of its
    own), wait until it answers, stop it on exit."""
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    cert = make_certificate(workdir) if tls else None
    server = Azurite(workdir, free_ports(1)[0], None, workdir / "debug.log", cert)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        _stop(server.process)


def _wait_ready(server: Azurite) -> None:
    from azure.storage.blob import BlobServiceClient

    deadline = time.monotonic() + READY_TIMEOUT_S
    last: Exception | None = None
    client = BlobServiceClient.from_connection_string(
        server.connection_string, connection_verify=str(server.cert) if server.cert else True
    )
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


def vllm_python(workdir: Path, cert: Path) -> Path:
    """A ``python`` for vLLM's run that trusts ``cert`` in Run:ai's C++ Azure backend, whose
    curl reads only ``/etc/ssl/certs/ca-certificates.crt``: the interpreter runs in a mount
    namespace of its own where that file is the system bundle plus ``cert`` (``unshare``;
    the machine's file is never touched). Raises ``OSError`` where namespaces are denied."""
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    bundle = workdir / "ca-bundle.crt"
    bundle.write_bytes((system.read_bytes() if system.exists() else b"") + cert.read_bytes())
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f"mount --bind {bundle} {system}"],
        capture_output=True, text=True,
    )  # fmt: skip
    if probe.returncode != 0:
        raise OSError(f"no private mount namespace here: {probe.stderr.strip()}")
    script = workdir / "python-with-ca"
    script.write_text(
        "#!/bin/sh\n"
        f"exec unshare --mount sh -c 'mount --bind {bundle} {system} && exec \"$@\"' "
        f'sh {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script
