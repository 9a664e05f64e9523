"""A registry token service for tests (the Docker token protocol that distribution's ``token``
auth speaks): ``GET /token?service=&scope=`` with the client's basic credentials answers
``{"token": JWT}``, an RS256 JWT whose ``x5c`` header carries the signing certificate, which
the registry trusts through its ``rootcertbundle``. Signed with the ``openssl`` binary, so no
crypto library is needed. Listens on 127.0.0.1; records the scopes it granted."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

SERVICE, ISSUER = "modelstage-test-registry", "modelstage-test-tokens"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenService:
    realm: str
    cert: Path
    key: Path
    user: str
    password: str
    granted: list[str] = field(default_factory=list)
    refused: int = 0

    def token(self, scope: str) -> str:
        der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
                             check=True, capture_output=True).stdout  # fmt: skip
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(der).decode()]}
        access = []
        if scope.startswith("repository:"):
            _, name, actions = scope.split(":", 2)
            access.append({"type": "repository", "name": name, "actions": actions.split(",")})
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": self.user, "aud": SERVICE, "exp": now + 300,
                  "nbf": now - 10, "iat": now, "jti": uuid.uuid4().hex, "access": access}  # fmt: skip
        signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)],
                                   input=signing_input.encode(), check=True,
                                   capture_output=True).stdout  # fmt: skip
        return f"{signing_input}.{_b64(signature)}"


def registry_auth_config(service: TokenService) -> dict[str, object]:
    """The registry's ``auth`` section for this service."""
    return {"token": {"realm": service.realm, "service": SERVICE, "issuer": ISSUER,
                      "rootcertbundle": str(service.cert)}}  # fmt: skip


@contextlib.contextmanager
def token_service(work: Path, user: str, password: str) -> Iterator[TokenService]:
    work.mkdir(parents=True, exist_ok=True)
    cert, key = work / "token-cert.pem", work / "token-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=modelstage-test-tokens", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)  # fmt: skip
    service: TokenService

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            want = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
            if self.headers.get("Authorization") != want:
                service.refused += 1
                self.send_response(401)
                self.end_headers()
                return
            scope = parse_qs(urlsplit(self.path).query).get("scope", [""])[0]
            service.granted.append(scope)
            body = json.dumps({"token": service.token(scope)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    service = TokenService(f"http://127.0.0.1:{port}/token", cert, key, user, password)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
