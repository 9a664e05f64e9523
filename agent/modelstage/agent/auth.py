"""Who is streaming: a copy Job's projected ServiceAccount token, checked by a TokenReview.

The agent trusts nothing the caller says about itself: the API server says whether the token
is valid for the agent's audience, whose ServiceAccount it is (that gives the namespace) and,
on Kubernetes 1.30 and later, which node the pod holding it runs on (the token's
``authentication.kubernetes.io/node-name`` claim). A token for another node is refused
always; a token without the claim only when the agent was told the cluster cannot give one
(``--allow-tokens-without-node``). Reviews are cached for a minute, by a hash of the token.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelstage.api.kube_client import KubeClient, resource_path
from modelstage.core.node_cache import AGENT_AUDIENCE

TOKEN_REVIEWS = resource_path("authentication.k8s.io/v1", "tokenreviews")
NODE_CLAIM = "authentication.kubernetes.io/node-name"
SA_PREFIX = "system:serviceaccount:"
CACHE_SECONDS = 60.0
CACHE_ENTRIES = 1024


class Refused(Exception):
    """A request the agent will not serve: the HTTP status and a line a person can act on."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Caller:
    namespace: str
    service_account: str


@dataclass
class TokenReviewer:
    kube: KubeClient
    node: str
    allow_without_node: bool = False
    clock: Callable[[], float] = time.monotonic
    _cache: dict[str, tuple[float, Caller | Refused]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def caller(self, authorization: str | None) -> Caller:
        """The namespace behind ``Authorization: Bearer <token>``, or ``Refused``."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Refused(401, "no bearer token: send the copy Job's projected token")
        key = hashlib.sha256(token.strip().encode()).hexdigest()
        now = self.clock()
        with self._lock:
            cached = self._cache.get(key)
        if cached is None or cached[0] <= now:
            cached = (now + CACHE_SECONDS, self._review(token.strip()))
            unavailable = isinstance(cached[1], Refused) and cached[1].status == 503
            with self._lock:
                if len(self._cache) >= CACHE_ENTRIES:
                    self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if not unavailable:  # the API server's outage is not the token's verdict
                    self._cache[key] = cached
        if isinstance(cached[1], Refused):
            raise cached[1]
        return cached[1]

    def _review(self, token: str) -> Caller | Refused:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [AGENT_AUDIENCE]},
        }
        try:
            review = self.kube.create(TOKEN_REVIEWS, body) or {}
        except Exception as e:
            return Refused(503, f"cannot review the token with the API server: {e}")
        return self.judge(review.get("status") or {})

    def judge(self, status: dict[str, Any]) -> Caller | Refused:
        """The TokenReview's verdict as this agent's rules read it."""
        if status.get("authenticated") is not True:
            why = status.get("error") or "not authenticated"
            return Refused(401, f"the token was refused by the API server: {why}")
        audiences = status.get("audiences")
        if isinstance(audiences, list) and AGENT_AUDIENCE not in audiences:
            return Refused(401, f"the token is not for the audience {AGENT_AUDIENCE}")
        user = status.get("user") or {}
        parts = str(user.get("username") or "").removeprefix(SA_PREFIX).split(":")
        if not str(user.get("username") or "").startswith(SA_PREFIX) or len(parts) != 2:
            return Refused(403, "only a ServiceAccount token of a copy Job may stream copies")
        nodes = (user.get("extra") or {}).get(NODE_CLAIM)
        if nodes is None and not self.allow_without_node:
            return Refused(
                403,
                "the token has no node claim (Kubernetes below 1.30?): the agent accepts such "
                "tokens only with --allow-tokens-without-node",
            )
        if nodes is not None and nodes != [self.node]:
            return Refused(403, f"the token is bound to a pod on node {nodes}, not {self.node}")
        return Caller(parts[0], parts[1])
