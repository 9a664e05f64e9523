"""A small real HTTP endpoint that answers TokenReviews as kube-apiserver does, for the node
agent's copy server when no control plane runs: the agent's own ``KubeClient`` POSTs to it
over HTTP, as it would to the API server.

Each token is registered with what the API server would know of it: the ServiceAccount, the
audiences it was issued for, and the node its pod runs on (the
``authentication.kubernetes.io/node-name`` extra that kube-apiserver 1.30+ adds for a token
bound to a pod). A review whose requested audiences do not intersect the token's is
unauthenticated, with the API server's error text; the status's ``audiences`` is the
intersection. The real API server's behaviour is checked by the tests that run on it
(``KUBEBUILDER_ASSETS``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client as k8s
from modelstage.api.kube_client import KubeClient

PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
AGENT_CREDENTIAL = "agent-credential"
"""What the agent authenticates its own requests with (checked: a review needs it)."""


@dataclass(frozen=True)
class Token:
    namespace: str
    service_account: str = "default"
    audiences: tuple[str, ...] = ("modelstage-node-agent",)
    node: str | None = "n1"
    user: str | None = None
    """A username other than the ServiceAccount's (a person's token)."""


@dataclass
class TokenReviewAPI:
    tokens: dict[str, Token] = field(default_factory=dict)
    reviews: int = 0
    server: ThreadingHTTPServer | None = None

    def start(self) -> TokenReviewAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != PATH:
                    self._send(404, {"kind": "Status", "message": "not found"})
                elif self.headers.get("Authorization") != f"Bearer {AGENT_CREDENTIAL}":
                    self._send(401, {"kind": "Status", "message": "Unauthorized"})
                else:
                    api.reviews += 1
                    self._send(201, api.review(body))

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def client(self) -> KubeClient:
        configuration = k8s.Configuration(host=self.url)
        configuration.api_key = {"BearerToken": AGENT_CREDENTIAL}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return KubeClient(k8s.ApiClient(configuration))

    def review(self, body: dict[str, Any]) -> dict[str, Any]:
        spec = body.get("spec") or {}
        token = self.tokens.get(spec.get("token", ""))
        out: dict[str, Any] = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                               "spec": spec, "status": {"user": {}}}  # fmt: skip
        if token is None:
            out["status"] = {"user": {}, "error": "invalid bearer token"}
            return out
        wanted = spec.get("audiences") or []
        common = [a for a in wanted if a in token.audiences]
        if wanted and not common:
            out["status"] = {"user": {}, "error": "token audiences [\"{}\"] is invalid for the "
                             "target audiences {}".format('","'.join(token.audiences), wanted)}  # fmt: skip
            return out
        username = token.user or (
            f"system:serviceaccount:{token.namespace}:{token.service_account}"
        )
        extra = {} if token.node is None else {
            "authentication.kubernetes.io/node-name": [token.node]}  # fmt: skip
        out["status"] = {"authenticated": True, "audiences": common or list(token.audiences),
                         "user": {"username": username, "extra": extra}}  # fmt: skip
        return out
