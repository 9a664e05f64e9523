"""The copy protocol over HTTP/1.1: what ``modelstage node-copy`` talks to (``receive.py`` does
the work; this module reads requests, authenticates them and writes JSON answers).

- ``POST /v1/offers?digest=D``, body the manifest: ``{content, need, complete, granted}``
- ``PUT /v1/copies/<content>/files/<name>``, body the file (``Content-Length`` its size)
- ``POST /v1/copies/<content>/commit?digest=D``: ``{content, bytes, files, alreadyComplete}``

Every request carries ``Authorization: Bearer <token>`` (``auth.py``). Errors are
``{"error": "<one line>"}``: 401/403 auth, 400 a bad request or manifest, 404 an unknown file,
409 a state conflict, 422 a chunk that does not match, 507 no room. A body the agent did not
read to its end closes the connection (the next request could not be told from its bytes).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from modelstage.core.manifest import MAX_MANIFEST_BYTES

from .auth import Caller, Refused, TokenReviewer
from .receive import Receiver

log = logging.getLogger("modelstage.agent")
OFFERS = re.compile(r"^/v1/offers$")
FILE = re.compile(r"^/v1/copies/([^/]+)/files/([^/]+)$")
COMMIT = re.compile(r"^/v1/copies/([^/]+)/commit$")
SOCKET_TIMEOUT = 120.0
"""Seconds a connection may stay silent mid-request before the agent drops it."""
DRAIN_BYTES = 64 * 1024 * 1024
DRAIN_SECONDS = 5.0
"""After a refusal mid-body, at most this much of the rest of the declared body is read and
discarded before the connection closes, so the client (still sending) reads the answer
rather than a reset; never more than the body's declared length."""


class CopyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], receiver: Receiver, reviewer: TokenReviewer
    ) -> None:
        super().__init__(address, CopyHandler)
        self.receiver = receiver
        self.reviewer = reviewer

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="modelstage-copies", daemon=True)
        thread.start()
        return thread


class CopyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT
    server: CopyServer
    server_version = "modelstage-agent"
    _left = 0

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_GET(self) -> None:
        self._serve()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("copy request: " + format, *args)

    def _serve(self) -> None:
        self._left = -1  # unknown until the header is read: a refusal then closes
        try:
            self._left = self._length()
            caller = self.server.reviewer.caller(self.headers.get("Authorization"))
            self._reply(200, self._route(caller))
        except Refused as e:
            self._reply(e.status, {"error": e.message})
        except Exception as e:
            log.exception("copy request %s %s failed", self.command, self.path)
            self._reply(500, {"error": f"the agent failed: {type(e).__name__}: {e}"})

    def _length(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise Refused(400, "send a Content-Length, not a chunked body")
        text = self.headers.get("Content-Length", "0")
        if not text.isdigit():
            raise Refused(400, f"Content-Length {text!r} is not a number of bytes")
        return int(text)

    def _route(self, caller: Caller) -> dict[str, Any]:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        receiver = self.server.receiver
        if self.command == "POST" and OFFERS.match(url.path):
            if self._left > MAX_MANIFEST_BYTES:
                raise Refused(400, f"the manifest is more than {MAX_MANIFEST_BYTES} bytes")
            return receiver.offer(caller.namespace, query.get("digest", ""), self._read(self._left))
        if self.command == "PUT" and (found := FILE.match(url.path)):
            content, name = unquote(found[1]), unquote(found[2])
            receiver.put_file(caller.namespace, content, name, self._left, self._read)
            return {"file": name}
        if self.command == "POST" and (found := COMMIT.match(url.path)):
            return receiver.commit(caller.namespace, unquote(found[1]), query.get("digest", ""))
        raise Refused(404, f"no such request: {self.command} {url.path}")

    def _drain(self) -> None:
        """Part of an unread body read and dropped (``DRAIN_BYTES``, ``DRAIN_SECONDS``)."""
        if self._left <= 0:
            return
        self.connection.settimeout(DRAIN_SECONDS)
        budget = DRAIN_BYTES
        try:
            while budget > 0 and self._left > 0:
                data = self._read(min(1 << 20, budget))
                if not data:
                    break
                budget -= len(data)
        except OSError:
            pass

    def _read(self, n: int) -> bytes:
        """At most ``n`` bytes of the body, never past its Content-Length."""
        data = self.rfile.read(min(n, self._left))
        self._left -= len(data)
        return data

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, sort_keys=True).encode()
        if self._left:
            self.close_connection = True
            self._drain()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
