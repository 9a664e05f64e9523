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
    abandoned: bool = False

    def release(self) -> None:
        self.released.set()

    def abandon(self) -> None:
        """The client died meanwhile: the held request never reaches the server (or, held
        after, its answer is never sent)."""
        self.abandoned = True
        self.released.set()

    async def wait_arrived(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.arrived.wait(), timeout)


@dataclass
class Refusal:
    """Answer the next ``times`` matching requests with ``status`` instead of the server."""

    method: str
    path: str
    status: int
    reason: str
    times: int
    answered: int = 0


@dataclass
class ApiGate:
    upstream: str
    token: str | None
    holds: list[Hold] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    muted: set[str] = field(default_factory=set)
    """Watch paths whose events are not passed on (the stream itself stays open)."""
    dropped: list[bytes] = field(default_factory=list)
    """The muted events, as the server sent them."""
    url: str = ""
    _session: aiohttp.ClientSession | None = None
    _tasks: set[asyncio.Task[object]] = field(default_factory=set)

    def hold(self, method: str, path: str, *, after: bool = False) -> Hold:
        """Holds the next ``method`` request to exactly ``path`` (query string aside), before
        it reaches the server, or with ``after`` its answer once the server has done it."""
        held = Hold(method.upper(), path, after)
        self.holds.append(held)
        return held

    def refuse(self, method: str, path: str, status: int, reason: str, times: int = 1) -> Refusal:
        """The next ``times`` ``method`` requests to ``path`` get a Kubernetes Status of
        ``status`` (e.g. 409 ``Conflict``), as if the server had answered so."""
        refusal = Refusal(method.upper(), path, status, reason, times)
        self.refusals.append(refusal)
        return refusal

    def mute(self, path: str) -> None:
        """Events of watches on ``path`` stop reaching the operator (a lost event)."""
        self.muted.add(path)

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
            if held.abandoned:
                return aiohttp.web.Response(status=503, text="abandoned by the tests' gate")
        refusal = next(
            (r for r in self.refusals
             if (r.method, r.path) == (request.method, request.path) and r.answered < r.times),
            None,
        )  # fmt: skip
        if refusal is not None:
            refusal.answered += 1
            message = f"{refusal.reason} (injected by the tests' API gate)"
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                 "message": message, "reason": refusal.reason, "code": refusal.status},
                status=refusal.status,
            )  # fmt: skip
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
                if held.abandoned:
                    return aiohttp.web.Response(status=503, text="abandoned by the tests' gate")
            response = aiohttp.web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_HEADERS and key.lower() != "content-encoding":
                    response.headers[key] = value
            await response.prepare(request)
            watch = request.query.get("watch") in ("true", "1")
            with contextlib.suppress(
                ConnectionResetError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError
            ):
                if watch:  # event by event (one JSON document a line), so events can be muted
                    async for line in upstream.content:
                        if request.path in self.muted:
                            self.dropped.append(line)
                        else:
                            await response.write(line)
                else:
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
