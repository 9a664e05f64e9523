"""A gate in front of the Kubernetes API for the operator: the tests hold one of its requests
until they have changed the cluster, which makes an interleaving that depends on timing (an
edit landing while a handler works) happen every time, on either tier.

An aiohttp reverse proxy on 127.0.0.1 (plain HTTP) in the test's event loop, forwarding every
request to the cluster's API server (the real one over HTTPS, or the fake) with its headers,
bearer token included, and streaming the answers back as they come (watches). ``hold(method,
path)`` holds the next matching request before it reaches the server; the test awaits
``arrived``, changes what it wants, then ``release()``s it, and the request goes on to see the
changed cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import aiohttp.web

from support.kube_cluster import Cluster, kubeconfig_token, write_kubeconfig

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass
class Hold:
    method: str
    path: str
    after: bool = False
    """Hold the answer (the server has done the request) instead of the request."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def release(self) -> None:
        self.released.set()

    async def wait_arrived(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.arrived.wait(), timeout)


@dataclass
class ApiGate:
    upstream: str
    token: str | None
    holds: list[Hold] = field(default_factory=list)
    url: str = ""
    _session: aiohttp.ClientSession | None = None
    _tasks: set[asyncio.Task[object]] = field(default_factory=set)

    def hold(self, method: str, path: str, *, after: bool = False) -> Hold:
        """Holds the next ``method`` request to exactly ``path`` (query string aside), before
        it reaches the server, or with ``after`` its answer once the server has done it."""
        held = Hold(method.upper(), path, after)
        self.holds.append(held)
        return held

    def kubeconfig(self, path: Path) -> Path:
        return write_kubeconfig(path, self.url, self.token)

    async def _forward(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await self._pump(request)
        finally:
            self._tasks.discard(task)

    async def _pump(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        held = next(
            (h for h in self.holds
             if (h.method, h.path) == (request.method, request.path) and not h.arrived.is_set()),
            None,
        )  # fmt: skip
        if held is not None and not held.after:
            held.arrived.set()
            await held.released.wait()
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = await request.read()
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body or None,
            ssl=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        ) as upstream:
            if held is not None and held.after:
                held.arrived.set()
                await held.released.wait()
            response = aiohttp.web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_HEADERS and key.lower() != "content-encoding":
                    response.headers[key] = value
            await response.prepare(request)
            with contextlib.suppress(
                ConnectionResetError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError
            ):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            await response.write_eof()
            return response


@contextlib.asynccontextmanager
async def api_gate(cluster: Cluster) -> AsyncIterator[ApiGate]:
    """A gate in front of ``cluster``'s API server for the operator (its token)."""
    gate = ApiGate(cluster.server.rstrip("/"), kubeconfig_token(cluster.kubeconfig))
    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", gate._forward)
    runner = aiohttp.web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    gate.url = f"http://127.0.0.1:{port}"
    gate._session = aiohttp.ClientSession(auto_decompress=False)
    try:
        yield gate
    finally:
        for held in gate.holds:
            held.release()
        for task in list(gate._tasks):  # the watches it still pumps for a stopped operator
            task.cancel()
        await gate._session.close()
        await runner.cleanup()
