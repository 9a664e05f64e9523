"""A loopback HTTP proxy in front of a real S3 server that injects faults on request.

It parses each request's head and ``Content-Length`` body (HTTP/1.1 clients such as urllib3
never pipeline, so request boundaries are enough) and pumps responses back unchanged. Faults,
switchable while clients are connected:

- ``throttle(n, every=k)``: of the next requests, every ``k``-th (``n`` of them in all) gets
  ``503 SlowDown`` (S3's throttling answer) without reaching the server;
- ``delay_s``: every response chunk is held back this long (a slow server);
- ``down()`` / ``up()``: every connection is cut and new ones are refused (the server
  stopped), then accepted again on the same port (the server restarted);
- ``down_on_request(text)``: go down when a request whose head holds ``text`` arrives,
  before it reaches the server (a crash at a chosen step, e.g. the first ``config.json``);
- ``cut_after_bytes(n)``: every open connection is cut once ``n`` more bytes (counted from
  this call) went through, in either direction (a crash in the middle of an upload or a
  download); one cut per call.

It counts the bytes sent to the server (``bytes_up``) and back (``bytes_down``), which tests
use as a progress measure, and the cuts it made (``cuts``, each with where it was armed and
where it fired: ``cut_log``), so a test can prove that a fault it armed fired, and where.
Everything binds to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)
SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)

DOWN_PIECE_BYTES = 65536
"""The most bytes one response read passes on: a cut lands at most this far past its mark."""
UP_PIECE_BYTES = 1 << 20
"""The most request-body bytes one read passes on."""


@dataclass(frozen=True)
class Cut:
    """One ``cut_after_bytes`` that fired: the proxy's byte count (both directions) when it
    was armed and when it cut, and the distance it was armed for."""

    armed_at: int
    after: int
    fired_at: int

    @property
    def offset(self) -> int:
        """Bytes that went through between arming and the cut."""
        return self.fired_at - self.armed_at


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname is not None and parts.port is not None
        self.upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.bytes_up = self.bytes_down = 0
        self.requests = self.throttled = self.cuts = 0
        self.cut_log: list[Cut] = []
        self.delay_s = 0.0
        self._throttle_next = self._seen = 0
        self._throttle_every = 1
        self._cut_budget: int | None = None
        self._cut_armed: tuple[int, int] = (0, 0)
        self._down_on: bytes | None = None
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- switches --------------------------------------------------------------------------
    def up(self) -> None:
        """Listen (again, on the same port after ``down``)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and reset every open one."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self._cut_all()

    def throttle(self, requests: int, *, every: int = 1) -> None:
        with self._lock:
            self._throttle_next, self._throttle_every, self._seen = requests, every, 0

    def down_on_request(self, text: str | None) -> None:
        self._down_on = text.encode() if text is not None else None

    def cut_after_bytes(self, nbytes: int | None) -> None:
        with self._lock:
            self._cut_budget = nbytes
            self._cut_armed = (self.bytes_up + self.bytes_down, nbytes or 0)

    def close(self) -> None:
        self.down()

    # -- plumbing --------------------------------------------------------------------------
    def _cut_all(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns), set()
        _close(*conns)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.add(sock)

    def _count(self, up: int, down: int) -> None:
        cut = False
        with self._lock:
            self.bytes_up += up
            self.bytes_down += down
            if self._cut_budget is not None:
                self._cut_budget -= up + down
                if self._cut_budget <= 0:
                    self._cut_budget, cut = None, True
                    self.cuts += 1
                    at = self.bytes_up + self.bytes_down
                    self.cut_log.append(Cut(*self._cut_armed, fired_at=at))
        if cut:
            self._cut_all()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._listener is not listener:  # accepted while going down
                _close(client)
                return
            self._track(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server: socket.socket | None = None
        try:
            server = socket.create_connection(self.upstream)
            self._track(server)
            threading.Thread(target=self._pump_down, args=(server, client), daemon=True).start()
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                if self._down_on is not None and self._down_on in head:
                    self._down_on = None
                    self.down()
                    return
                length = _content_length(head)
                with self._lock:
                    self.requests += 1
                    self._seen += 1
                    throttled = self._throttle_next > 0 and self._seen % self._throttle_every == 0
                    if throttled:
                        self._throttle_next -= 1
                        self.throttled += 1
                if throttled:
                    if b"100-continue" not in head.lower():
                        while len(buf) < length:
                            chunk = client.recv(65536)
                            if not chunk:
                                return
                            buf += chunk
                    client.sendall(SLOW_DOWN % (len(SLOW_DOWN_BODY), SLOW_DOWN_BODY))
                    return
                server.sendall(head + b"\r\n\r\n")
                self._count(len(head) + 4, 0)
                remaining = length
                while remaining > 0:
                    if not buf:
                        buf = client.recv(min(remaining, UP_PIECE_BYTES))
                        if not buf:
                            return
                    piece, buf = buf[:remaining], buf[remaining:]
                    server.sendall(piece)
                    remaining -= len(piece)
                    self._count(len(piece), 0)
        except OSError:
            return
        finally:
            _close(client, server)

    def _pump_down(self, server: socket.socket, client: socket.socket) -> None:
        try:
            while chunk := server.recv(DOWN_PIECE_BYTES):
                if self.delay_s:
                    time.sleep(self.delay_s)
                client.sendall(chunk)
                self._count(0, len(chunk))
        except OSError:
            pass
        finally:
            _close(client, server)


def _close(*socks: socket.socket | None) -> None:
    """Shut down, then close: close() alone does not wake a thread blocked in recv() on the
    socket, and the peer would wait for its read timeout instead of seeing the connection end.
    """
    for sock in socks:
        if sock is None:
            continue
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


@contextlib.contextmanager
def fault_proxy(upstream: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream)
    try:
        yield proxy
    finally:
        proxy.close()
