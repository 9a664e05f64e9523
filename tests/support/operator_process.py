"""The operator as the tests run it: ``python -P -m modelstage.operator`` in a subprocess.

The working directory is a temporary folder (where the operator's log goes), the kubeconfig
from the cluster fixture, kopf in standalone mode (no peering), and short watch timeouts. Waiting is
done with ``asyncio.sleep``: the kmock API server runs in the same event loop as the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from support.kube_cluster import free_port

TEST_SETTINGS = {
    "MODELSTAGE_OPERATOR_WATCH_SERVER_TIMEOUT": "20",
    "MODELSTAGE_OPERATOR_WATCH_CLIENT_TIMEOUT": "25",
    "MODELSTAGE_OPERATOR_CONNECT_TIMEOUT": "5",
    "MODELSTAGE_OPERATOR_REQUEST_TIMEOUT": "10",
    # Events must drive the operator in these tests, not the safety-net timer.
    "MODELSTAGE_OPERATOR_RESYNC_INTERVAL": "600",
    "MODELSTAGE_OPERATOR_FAILED_BACKOFF": "2",
    "MODELSTAGE_OPERATOR_FAILED_BACKOFF_MAX": "8",
    "MODELSTAGE_OPERATOR_CONFLICT_DELAY": "0.5",
    "MODELSTAGE_OPERATOR_STAGER_IMAGE": "registry.test/modelstage/stager:test",
}


@dataclass
class OperatorProcess:
    kubeconfig: Path
    namespace: str
    workdir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    metrics_port: int = field(default_factory=free_port)
    priority: int | None = None
    """With a priority, kopf's peering instead of ``--standalone`` (the namespace's
    KopfPeering must exist)."""
    args: list[str] | None = None
    """The operator's arguments instead of ``--namespace`` with standalone/priority (e.g. the
    chart's own)."""
    verbose: bool = False
    """kopf's debug log (watch restarts, patches)."""
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / f"operator-{self.starts}.log"

    def logs(self) -> str:
        return "".join(
            (self.workdir / f"operator-{n}.log").read_text(errors="replace")
            for n in range(1, self.starts + 1)
            if (self.workdir / f"operator-{n}.log").exists()
        )

    def log_records(self) -> list[dict[str, Any]]:
        records = []
        for line in self.logs().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def log_offset(self) -> int:
        """Where the current process's log ends now: ``current_records(since=...)`` reads on."""
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def current_records(self, since: int = 0) -> list[dict[str, Any]]:
        """The current process's JSON log records from byte ``since`` on (a partly written
        last line is left for the next read)."""
        if not self.log_path.exists():
            return []
        with open(self.log_path, "rb") as f:
            f.seek(since)
            raw = f.read()
        records = []
        for line in raw.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def handled(self, handler: str) -> bool:
        """Whether the current process has run ``handler`` successfully (kopf's log line)."""
        return self.count(f"Handler '{handler}' succeeded.") > 0

    def count(self, text: str) -> int:
        """How often the current process has logged ``text`` (kopf's handler outcomes:
        ``Handler 'x' succeeded.``, ``Handler 'x' failed temporarily``, ...)."""
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return log.count(text)

    async def start(self, timeout: float = 30.0) -> None:
        assert self.process is None or self.process.poll() is not None
        self.starts += 1
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("MODELSTAGE_OPERATOR_")},
            **TEST_SETTINGS,
            "KUBECONFIG": str(self.kubeconfig),
            # The log is evidence the tests wait for, and a SIGKILL must not lose its tail.
            "PYTHONUNBUFFERED": "1",
            "MODELSTAGE_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "MODELSTAGE_OPERATOR_METRICS_HOST": "127.0.0.1",
            **self.extra_env,
        }
        env.pop("PYTHONPATH", None)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-P",
                    "-m",
                    "modelstage.operator",
                    *(self.args if self.args is not None else self._scope()),
                    "--log-format=json",
                    *(
                        ["--verbose"]
                        if self.verbose or os.environ.get("MODELSTAGE_TEST_OPERATOR_VERBOSE")
                        else []
                    ),
                ],
                cwd=self.workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        await self.wait_ready(timeout)

    def _scope(self) -> list[str]:
        peering = ["--standalone"] if self.priority is None else ["--priority", str(self.priority)]
        return [*peering, "--namespace", self.namespace]

    async def wait_ready(self, timeout: float) -> None:
        """Ready when the startup handler has run (metrics answer) and kopf watches."""
        deadline = asyncio.get_running_loop().time() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(
                        f"the operator exited ({self.process.returncode}):\n{self.logs()[-4000:]}"
                    )
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
                        if r.status == 200:
                            break
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(
                        f"the operator did not start in {timeout} s:\n{self.logs()[-4000:]}"
                    )
                await asyncio.sleep(0.1)
        # The first list+watch of every resource follows the startup handler within moments.
        await asyncio.sleep(0.5)

    async def scrape(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return await response.text()

    async def kill(self) -> None:
        """SIGKILL: no cleanup, no final writes."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        await self._reap(10.0)

    async def stop(self, graceful: bool = True) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            await self._reap(8.0)
        except TimeoutError:
            self.process.kill()
            await self._reap(5.0)

    async def _reap(self, timeout: float) -> None:
        assert self.process is not None
        deadline = asyncio.get_running_loop().time() + timeout
        while self.process.poll() is None:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the operator did not exit")
            await asyncio.sleep(0.05)
